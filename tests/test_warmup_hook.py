"""The chart's warm-up hook (kvtune/helm/warmup_hook.py), run as the pod runs it: a stand-alone script in a
subprocess. Against a stand-in server it waits for /health, sends what `kvtune up` sends (recorded from
kvtune.warmup itself, so the two cannot drift), keeps the key out of its output and is bounded by
readyTimeoutS; against a real engine its warm-up is what the next chat finds in the prefix cache. Against
hostile inputs (a pipe, a device or a huge file as its prefixes, a key with a newline, a URL with a password,
an engine that answers 400 MB or never) every run ends in bounded time and memory with one line and its exit
code. Its pieces, with generated inputs, are tested in-process in tests/test_warmup_hook_bounds.py."""

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
from kvtune.helm import warmup_hook
from kvtune.profile import EngineProfile
from tests.helpers import REPO, default_profile_data
from tests.hostile_servers import (
    MIB,
    HostileServer,
    Request,
    endless_body,
    hostile_server,
    huge_body,
    json_reply,
    redirect,
    sequence,
    silent,
    slow_loris,
    text,
)
from tests.peak_rss import measured, read_report
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
REFUSED_S = 5.0  # a refused input: the interpreter's start, then a refusal without waiting for anything
PEAK_RSS = 64 * MIB  # the hook runs in ~22 MB; a 400 MB answer or file read whole would be far above
SECRET = "sk-PLANTED-warmup-5e1f0c"  # grepped for in everything the hook prints


@dataclass
class HookRun:
    returncode: int
    output: str  # stdout and stderr
    log_copy: str  # what the hook wrote where PID 1's stderr would be
    elapsed_s: float
    peak_rss: int  # bytes

    def assert_one_line(self, code: int, words: str) -> None:
        """Exit `code` with one line saying `words`, the same line in the log copy, no traceback."""
        assert self.returncode == code, self.output
        assert self.output.count("\n") == 1 and words in self.output, self.output
        assert self.log_copy == self.output
        assert "Traceback" not in self.output


def run_hook(
    tmp_path: Path,
    document: Any,
    url: str,
    env: dict[str, str] | None = None,
) -> HookRun:
    """Run the hook as the pod does: `python3 -I warmup_hook.py prefixes.json`, its exit code and peak
    memory measured apart. A str or bytes `document` is the file's content, a Path the file itself (a pipe,
    a device); anything else is written as JSON. Bounded: a run may not outlast readyTimeoutS by much, so
    120 s is a hang; each run's memory is checked against PEAK_RSS and its output for the planted SECRET."""
    if isinstance(document, Path):
        prefixes = document
    else:
        prefixes = tmp_path / f"prefixes-{uuid.uuid4().hex[:8]}.json"
        content = document if isinstance(document, str | bytes) else json.dumps(document)
        prefixes.write_bytes(content.encode() if isinstance(content, str) else content)
    log_copy = tmp_path / f"main-process-stderr-{uuid.uuid4().hex[:8]}.log"
    log_copy.write_text("")
    report = tmp_path / f"peak-{uuid.uuid4().hex[:8]}.json"
    environ = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    environ |= {"KVTUNE_WARMUP_URL": url, "KVTUNE_WARMUP_LOG_COPY": str(log_copy)} | (env or {})
    start = time.monotonic()
    done = subprocess.run(
        measured([sys.executable, "-I", str(HOOK), str(prefixes)], report),
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - start
    code, peak = read_report(report)
    assert code == done.returncode
    run = HookRun(done.returncode, done.stdout + done.stderr, log_copy.read_text(), elapsed, peak)
    assert peak < PEAK_RSS, run
    assert SECRET not in run.output + run.log_copy
    return run


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
    assert "whitespace" not in run.output  # the key was given as it is sent
    # Every line also reached the main process's stderr (what `kubectl logs` shows), and none says too much.
    assert run.log_copy and run.log_copy in run.output
    assert f"prefix 0 (system, {len(SYSTEM_TEXT)} chars): warmed" in run.log_copy
    for secret in (key, "SYSTEM-PREFIX-7f3a", "RAW-PREFIX-c41d"):
        assert secret not in run.output + run.log_copy


# What each fault leaves in the log, besides the deadline.
FAULTS = {
    "health answers 503": "/health HTTP 503",
    "nothing listens": "/health no answer (Connection refused)",
    "health never answers": "/health no answer (timed out)",
    "health drips a byte at a time": "/health answer not finished within 2 s",
    "a prefix is never answered": "",
    "a prefix drips a byte at a time": "",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_whole_run_is_bounded_by_ready_timeout(
    hostile_server: HostileServer, tmp_path: Path, fault: str
) -> None:
    answering(hostile_server)
    url = hostile_server.url
    if fault == "health answers 503":
        hostile_server.route("/health", text("loading", status=503))
    elif fault == "nothing listens":
        url = f"http://127.0.0.1:{free_port()}"
    elif fault == "health never answers":
        hostile_server.route("/health", silent())
    elif fault == "health drips a byte at a time":
        hostile_server.route("/health", slow_loris(interval_s=0.1))
    elif fault == "a prefix is never answered":
        hostile_server.route("/v1/chat/completions", silent())
    else:
        hostile_server.route("/v1/chat/completions", slow_loris(interval_s=0.1))
    run = run_hook(tmp_path, document(PREFIXES, SHORT_TIMEOUT_S), url)
    assert run.returncode == 0, run.output  # a missed warm-up never fails the container
    assert SHORT_TIMEOUT_S <= run.elapsed_s < SHORT_TIMEOUT_S + MARGIN_S
    assert "readyTimeoutS (3 s) reached" in run.output
    assert "warmed 0 of 2 prefix(es)" in run.output
    assert FAULTS[fault] in run.output
    if fault.startswith("a prefix"):  # the hung prefix was sent, the deadline cut it
        assert [path for path, _body in posts(hostile_server.requests)] == ["/v1/chat/completions"]
    else:
        assert posts(hostile_server.requests) == []


def test_an_answer_of_400_mb_or_without_end_is_read_no_further_than_its_cap(
    hostile_server: HostileServer, tmp_path: Path
) -> None:
    answering(hostile_server)
    hostile_server.route("/v1/chat/completions", huge_body(400 * MIB))
    hostile_server.route("/v1/completions", endless_body())
    run = run_hook(tmp_path, document(PREFIXES), hostile_server.url)
    assert run.returncode == 0, run.output
    cut = "answer larger than 1024 KiB, not read, skipped"
    assert f"prefix 0 (system, {len(SYSTEM_TEXT)} chars): {cut}" in run.output
    assert f"prefix 1 (raw, {len(RAW_TEXT)} chars): {cut}" in run.output
    assert "warmed 0 of 2 prefix(es)" in run.output
    assert run.elapsed_s < 30.0  # two MiB read, far from the 60 s readyTimeoutS; memory: PEAK_RSS


def test_a_redirect_is_not_followed_and_the_key_stays_home(
    hostile_server: HostileServer, tmp_path: Path
) -> None:
    with HostileServer() as elsewhere:
        answering(elsewhere)
        answering(hostile_server)
        hostile_server.route("/v1/chat/completions", redirect(f"{elsewhere.url}/v1/chat/completions", 307))
        run = run_hook(tmp_path, document(PREFIXES), hostile_server.url, env={"VLLM_API_KEY": SECRET})
        assert elsewhere.requests == []
    assert run.returncode == 0, run.output
    assert "prefix 0 (system," in run.output and "HTTP 307, skipped" in run.output
    assert "warmed 1 of 2 prefix(es)" in run.output


@pytest.mark.parametrize("around", ["\n", "\r\n", " \t", "\n\n  "])
def test_a_key_with_whitespace_around_it_is_sent_without_and_never_printed(
    hostile_server: HostileServer, tmp_path: Path, around: str
) -> None:
    """`kubectl create secret generic k --from-file=api-key=key.txt` keeps the file's final newline."""
    answering(hostile_server)
    run = run_hook(
        tmp_path, document(PREFIXES), hostile_server.url, env={"VLLM_API_KEY": around + SECRET + around}
    )
    assert run.returncode == 0, run.output
    sent = [r for r in hostile_server.requests if r.method == "POST"]
    assert [r.headers.get("authorization") for r in sent] == [f"Bearer {SECRET}"] * 2
    assert "VLLM_API_KEY has whitespace around it" in run.output
    assert "warmed 2 of 2 prefix(es)" in run.output


@pytest.mark.parametrize(
    ("key", "kind"),
    [
        (f"{SECRET}\n{SECRET}", "a space"),  # two lines: a file holding more than the key
        (f"{SECRET}\x01{SECRET}", "a control or non-ASCII character"),
        (f"{SECRET}\x1b[0m", "a control or non-ASCII character"),
        (f"{SECRET}é", "a control or non-ASCII character"),
        (f"{SECRET} {SECRET}", "a space"),
    ],
)
def test_a_key_no_header_can_carry_is_refused_without_quoting_it(
    hostile_server: HostileServer, tmp_path: Path, key: str, kind: str
) -> None:
    answering(hostile_server)
    run = run_hook(tmp_path, document(PREFIXES), hostile_server.url, env={"VLLM_API_KEY": key})
    run.assert_one_line(2, f"VLLM_API_KEY: holds {kind} inside the key")
    assert run.elapsed_s < REFUSED_S
    assert hostile_server.requests == []


@pytest.mark.parametrize(
    "shape",
    [
        "http://user:{secret}@{host}",
        "http://{secret}@{host}",
        "http://{secret}:@{host}/v1",
        "https://{host}/?token={secret}",
        "http://{host}/#{secret}",
        "http://u:{secret}@{host}/?key={secret}",
    ],
)
def test_a_url_with_a_credential_is_refused_and_shown_without_it(
    hostile_server: HostileServer, tmp_path: Path, shape: str
) -> None:
    answering(hostile_server)
    url = shape.format(secret=SECRET, host=f"127.0.0.1:{hostile_server.port}")
    run = run_hook(tmp_path, document(PREFIXES), url)
    run.assert_one_line(2, "KVTUNE_WARMUP_URL '")
    assert "***" in run.output
    assert run.elapsed_s < REFUSED_S
    assert hostile_server.requests == []


@pytest.mark.parametrize("kind", ["a pipe", "a device", "a folder", "a file over 1 MiB", "no file"])
def test_a_prefixes_file_that_is_not_a_small_regular_file_is_refused_at_once(
    hostile_server: HostileServer, tmp_path: Path, kind: str
) -> None:
    """A pipe nobody writes to would block a plain open for ever; /dev/zero never ends; the alarm is set
    before the file is opened all the same."""
    answering(hostile_server)
    path, problem = {
        "a pipe": (tmp_path / "fifo", "is a pipe, not a regular file"),
        "a device": (Path("/dev/zero"), "is a device or socket, not a regular file"),
        "a folder": (tmp_path, "is a folder, not a regular file"),
        "a file over 1 MiB": (tmp_path / "big.json", "is larger than 1024 KiB, more than a ConfigMap holds"),
        "no file": (tmp_path / "missing.json", "cannot be opened (No such file or directory)"),
    }[kind]
    if kind == "a pipe":
        os.mkfifo(path)
    elif kind == "a file over 1 MiB":  # valid JSON, only too large
        path.write_text(json.dumps(document([{"role": "raw", "text": "x" * warmup_hook.MAX_FILE_BYTES}])))
    run = run_hook(tmp_path, path, hostile_server.url)
    run.assert_one_line(2, f"prefixes file '{path}': {problem} (a chart bug: the hook fails)")
    assert run.elapsed_s < REFUSED_S
    assert hostile_server.requests == []


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
        ("{not json", "is not JSON at line 1 column 2"),
        ([PREFIXES], "not a JSON object"),
        (document([{"role": "user", "text": "hi"}]), "prefixes[0].role: 'user' is not one of system, raw"),
        (document([{"text": "hi"}]), "prefixes[0]: must be an object with exactly the keys role and text"),
        (document([PREFIXES[0], {"role": "raw", "text": 7}]), "prefixes[1].text: must be a non-empty string"),
        ({"model": MODEL, "readyTimeoutS": 60, "prefixes": {"role": "raw"}}, "prefixes: must be a list"),
        ({"readyTimeoutS": 60, "prefixes": PREFIXES}, "model: the served model name must be a non-empty"),
        (document(PREFIXES) | {"readyTimeoutS": "60"}, "readyTimeoutS: '60' is not a number; give seconds"),
        (document(PREFIXES) | {"readyTimeoutS": 0}, "readyTimeoutS: 0 is out of range; give seconds from 1"),
        (document(PREFIXES) | {"readyTimeoutS": 1e300}, "readyTimeoutS: 1e+300 is out of range"),
        (document(PREFIXES) | {"readyTimeoutS": 1e-300}, "readyTimeoutS: 1e-300 is out of range"),
        ('{"model": "m", "readyTimeoutS": 1e999, "prefixes": []}', "readyTimeoutS: inf is out of range"),
        ('{"model": "m", "readyTimeoutS": NaN, "prefixes": []}', "NaN is not standard JSON"),
        ('{"model": "m", "model": "n", "readyTimeoutS": 9, "prefixes": []}', "key 'model' is written twice"),
        pytest.param("[" * 100_000 + "]" * 100_000, "nests more than 50 levels deep", id="100000 deep"),
        (b'{"model": "\xff"}', "is not UTF-8 text (at byte 11)"),
        (document(PREFIXES) | {"readyTimeout": 60}, "unknown key 'readyTimeout'"),
    ],
)
def test_a_malformed_file_fails_loudly_and_sends_nothing(
    hostile_server: HostileServer, tmp_path: Path, content: Any, problem: str
) -> None:
    answering(hostile_server)
    run = run_hook(tmp_path, content, hostile_server.url)
    run.assert_one_line(2, problem)
    assert "a chart bug" in run.output
    assert run.elapsed_s < REFUSED_S
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
