"""The chart's warm-up hook (kvtune/helm/warmup_hook.py), run as the pod runs it: a stand-alone script in a
subprocess. Against a stand-in server it waits for /health, sends what `kvtune up` sends (recorded from
kvtune.warmup itself, so the two cannot drift), keeps the key out of its output and is bounded by
readyTimeoutS; against a real engine its warm-up is what the next chat finds in the prefix cache."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune import openai_client, warmup
from kvtune.engine import Engine, free_port
from kvtune.profile import EngineProfile
from tests.helpers import REPO, default_profile_data
from tests.hostile_servers import HostileServer, Request, hostile_server, json_reply, sequence, silent, text
from tests.prompts import CacheCounters, chat_prompt_ids, long_text, shared_prefix_tokens

__all__ = ["hostile_server"]  # the fixture, imported for pytest

HOOK = REPO / "kvtune" / "helm" / "warmup_hook.py"
MODEL = "served-name"
SYSTEM_TEXT = "SYSTEM-PREFIX-7f3a: you answer questions about the handbook. " * 5
RAW_TEXT = "RAW-PREFIX-c41d: the handbook, chapter one. " * 5
PREFIXES = [{"role": "system", "text": SYSTEM_TEXT}, {"role": "raw", "text": RAW_TEXT}]
ANSWER = {"choices": [{"text": "ok", "message": {"content": "ok"}}]}
SHORT_TIMEOUT_S = 3.0
MARGIN_S = 5.0  # interpreter start and the alarm's delivery, far above either


@dataclass
class HookRun:
    returncode: int
    output: str  # stdout and stderr
    log_copy: str  # what the hook wrote where PID 1's stderr would be
    elapsed_s: float


def run_hook(
    tmp_path: Path,
    document: Any,
    url: str,
    env: dict[str, str] | None = None,
) -> HookRun:
    """Run the hook as the pod does: `python3 warmup_hook.py prefixes.json` (a str `document` is the file)."""
    prefixes = tmp_path / f"prefixes-{uuid.uuid4().hex[:8]}.json"
    prefixes.write_text(document if isinstance(document, str) else json.dumps(document))
    log_copy = tmp_path / "main-process-stderr.log"
    log_copy.write_text("")
    environ = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    environ |= {"KVTUNE_WARMUP_URL": url, "KVTUNE_WARMUP_LOG_COPY": str(log_copy)} | (env or {})
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(HOOK), str(prefixes)],
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    elapsed = time.monotonic() - start
    return HookRun(done.returncode, done.stdout + done.stderr, log_copy.read_text(), elapsed)


def document(prefixes: list[dict[str, Any]], timeout_s: float = 60.0) -> dict[str, Any]:
    return {"model": MODEL, "readyTimeoutS": timeout_s, "prefixes": prefixes}


def posts(requests: list[Request]) -> list[tuple[str, Any]]:
    return [(r.path, json.loads(r.body)) for r in requests if r.method == "POST"]


def answering(server: HostileServer, health: Any = None) -> None:
    server.route("/health", health or json_reply({}))
    server.route("/v1/chat/completions", json_reply(ANSWER))
    server.route("/v1/completions", json_reply(ANSWER))


def test_the_hook_is_standalone_python_3_9() -> None:
    """vLLM's image has python3 without kvtune or httpx: the script imports the standard library only."""
    tree = ast.parse(HOOK.read_text(encoding="utf-8"), feature_version=(3, 9))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported - {"__future__"} <= sys.stdlib_module_names


def test_waits_for_health_then_sends_what_kvtune_up_sends(
    hostile_server: HostileServer, tmp_path: Path
) -> None:
    unhealthy = text("loading", status=503)
    answering(hostile_server, health=sequence(unhealthy, unhealthy, json_reply({})))
    run = run_hook(tmp_path, document(PREFIXES), hostile_server.url)
    assert run.returncode == 0, run.output
    requests = list(hostile_server.requests)
    paths = [r.path for r in requests]
    # Three health checks (503, 503, 200), and only then the prefixes, in order.
    assert paths == ["/health"] * 3 + ["/v1/chat/completions", "/v1/completions"]
    assert all("authorization" not in r.headers for r in requests)  # no key, no header
    assert "/health HTTP 503" in run.output
    assert re.search(r"warmed 2 of 2 prefix\(es\) in \d+\.\d s", run.output)

    # kvtune up's own warm-up against the same server sends the very same requests.
    profile = EngineProfile.model_validate(
        default_profile_data(name="hook", port=hostile_server.port, served_model_name=MODEL, warmup=PREFIXES)
    )
    hostile_server.requests.clear()
    with openai_client.client_for(None) as client:
        warmup.warm_up(profile, client)
    assert posts(requests) == posts(hostile_server.requests)
    system, raw = (body for _path, body in posts(requests))
    assert system["model"] == raw["model"] == MODEL
    assert system["max_tokens"] == raw["max_tokens"] == 1
    assert system["messages"] == [
        {"role": "system", "content": SYSTEM_TEXT},
        {"role": "user", "content": "Hello."},
    ]
    assert raw["prompt"] == RAW_TEXT


def test_sends_the_key_and_never_prints_it_nor_the_prefixes(
    hostile_server: HostileServer, tmp_path: Path
) -> None:
    key = f"key-{uuid.uuid4().hex}"
    answering(hostile_server)
    run = run_hook(tmp_path, document(PREFIXES), hostile_server.url, env={"VLLM_API_KEY": key})
    assert run.returncode == 0, run.output
    sent = [r for r in hostile_server.requests if r.method == "POST"]
    assert [r.headers.get("authorization") for r in sent] == [f"Bearer {key}"] * 2
    # Every line also reached the main process's stderr (what `kubectl logs` shows), and none says too much.
    assert run.log_copy and run.log_copy in run.output
    assert f"prefix 0 (system, {len(SYSTEM_TEXT)} chars): warmed" in run.log_copy
    for secret in (key, "SYSTEM-PREFIX-7f3a", "RAW-PREFIX-c41d"):
        assert secret not in run.output + run.log_copy


@pytest.mark.parametrize("fault", ["health answers 503", "nothing listens", "a prefix is never answered"])
def test_the_whole_run_is_bounded_by_ready_timeout(
    hostile_server: HostileServer, tmp_path: Path, fault: str
) -> None:
    answering(hostile_server)
    url = hostile_server.url
    if fault == "health answers 503":
        hostile_server.route("/health", text("loading", status=503))
    elif fault == "nothing listens":
        url = f"http://127.0.0.1:{free_port()}"
    else:
        hostile_server.route("/v1/chat/completions", silent())
    run = run_hook(tmp_path, document(PREFIXES, SHORT_TIMEOUT_S), url)
    assert run.returncode == 0, run.output  # a missed warm-up never fails the container
    assert SHORT_TIMEOUT_S <= run.elapsed_s < SHORT_TIMEOUT_S + MARGIN_S
    assert "readyTimeoutS (3 s) reached" in run.output
    assert "warmed 0 of 2 prefix(es)" in run.output
    if fault == "a prefix is never answered":  # the hung prefix was sent, the deadline cut it
        assert [path for path, _body in posts(hostile_server.requests)] == ["/v1/chat/completions"]
    else:
        assert posts(hostile_server.requests) == []


def test_a_failing_prefix_is_logged_and_the_next_one_sent(
    hostile_server: HostileServer, tmp_path: Path
) -> None:
    answering(hostile_server)
    hostile_server.route("/v1/chat/completions", json_reply({"error": "boom"}, status=500))
    # KVTUNE_WARMUP_LOG_COPY empty: stderr only.
    run = run_hook(tmp_path, document(PREFIXES), hostile_server.url, env={"KVTUNE_WARMUP_LOG_COPY": ""})
    assert run.returncode == 0, run.output
    assert run.log_copy == ""
    assert [path for path, _body in posts(hostile_server.requests)] == [
        "/v1/chat/completions",
        "/v1/completions",
    ]
    assert f"prefix 0 (system, {len(SYSTEM_TEXT)} chars): HTTP 500, skipped" in run.output
    assert f"prefix 1 (raw, {len(RAW_TEXT)} chars): warmed" in run.output
    assert "warmed 1 of 2 prefix(es)" in run.output


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not readable as JSON"),
        ([PREFIXES], "not a JSON object"),
        (document([{"role": "user", "text": "hi"}]), "prefixes[0].role: 'user' is not one of system, raw"),
        (document([{"text": "hi"}]), "prefixes[0]: must be an object with exactly the keys role and text"),
        (document([PREFIXES[0], {"role": "raw", "text": 7}]), "prefixes[1].text: must be a non-empty string"),
        ({"model": MODEL, "readyTimeoutS": 60, "prefixes": {"role": "raw"}}, "prefixes: must be a list"),
        ({"readyTimeoutS": 60, "prefixes": PREFIXES}, "model: the served model name must be a non-empty"),
        (document(PREFIXES) | {"readyTimeoutS": "60"}, "readyTimeoutS: '60' is not a positive number"),
        (document(PREFIXES) | {"readyTimeoutS": 0}, "readyTimeoutS: '0' is not a positive number"),
        (document(PREFIXES) | {"readyTimeout": 60}, "unknown key 'readyTimeout'"),
    ],
)
def test_a_malformed_file_fails_loudly_and_sends_nothing(
    hostile_server: HostileServer, tmp_path: Path, content: Any, problem: str
) -> None:
    answering(hostile_server)
    run = run_hook(tmp_path, content, hostile_server.url)
    assert run.returncode == 2, run.output
    assert problem in run.output
    assert "a chart bug" in run.output
    assert hostile_server.requests == []


def test_a_url_that_is_not_http_fails_loudly(hostile_server: HostileServer, tmp_path: Path) -> None:
    run = run_hook(tmp_path, document(PREFIXES), f"127.0.0.1:{hostile_server.port}")
    assert run.returncode == 2, run.output
    assert "KVTUNE_WARMUP_URL '127.0.0.1:" in run.output
    assert hostile_server.requests == []


@pytest.mark.engine
def test_the_hook_fills_a_real_engines_prefix_cache(
    default_engine: Engine, model_path: str, tmp_path: Path
) -> None:
    profile = default_engine.profile
    system = long_text(f"warmup-hook-{uuid.uuid4().hex}", sentences=60)  # ~600 tokens, new to the cache
    warm_chat = [{"role": "system", "content": system}, {"role": "user", "content": "Hello."}]
    next_chat = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which note has a falcon?"},
    ]
    block = profile.effective_block_size
    shared = shared_prefix_tokens(model_path, warm_chat, next_chat)
    assert shared >= 4 * block  # several whole blocks the next chat can reuse
    with httpx.Client(timeout=300.0) as client:
        before = CacheCounters.of(profile.url, client)
        hook_document = {
            "model": profile.api_model_name,
            "readyTimeoutS": 300,
            "prefixes": [{"role": "system", "text": system}],
        }
        run = run_hook(tmp_path, hook_document, profile.url)
        assert run.returncode == 0, run.output
        assert "warmed 1 of 1 prefix(es)" in run.output
        # The engine looked the whole warm-up chat up, and found none of it cached before.
        warmed = before.after(profile.url, client, len(chat_prompt_ids(model_path, warm_chat)))
        assert warmed.hits == before.hits
        openai_client.chat(client, profile.url, profile.api_model_name, next_chat, max_tokens=1)
        after = warmed.after(profile.url, client, len(chat_prompt_ids(model_path, next_chat)))
    # The next chat found every whole block of the system prompt the hook sent.
    assert after.hits - warmed.hits >= shared // block * block
