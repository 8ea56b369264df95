"""`kvtune up` on real engines: the warm-up fills the prefix cache, a killed engine comes back warm, SIGTERM
drains and leaves nothing behind. Assertions read the engine's own counters, never how fast it answered."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune import metrics, openai_client
from kvtune.engine import free_port, group_members
from tests.helpers import ARTIFACTS, vllm_keeps_fp8_kv, write_test_profile
from tests.prompts import CacheCounters, long_text, shared_prefix_tokens

WARM_SYSTEM_PROMPT = long_text("warm-up", sentences=170)
USER_TURN = "Which note mentions a falcon?"
MODEL = "smollm2-135m"
# What kvtune's warm-up sends for a system prefix (kvtune.warmup): the prefix, then a short user turn.
WARMUP_CHAT = [{"role": "system", "content": WARM_SYSTEM_PROMPT}, {"role": "user", "content": "Hello."}]
USER_CHAT = [{"role": "system", "content": WARM_SYSTEM_PROMPT}, {"role": "user", "content": USER_TURN}]


@dataclass
class UpRun:
    proc: subprocess.Popen[bytes]
    control_url: str
    stderr_path: Path
    engine_pgids: set[int]

    def engines(self) -> list[dict[str, Any]]:
        return list(httpx.get(f"{self.control_url}/engines", timeout=5).json())

    def wait_for(self, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"kvtune up exited: {self.stderr_path.read_text()[-2000:]}"
            try:
                status = self.engines()[0]
            except (httpx.HTTPError, IndexError):
                status = None
            if status and predicate(status):
                if status.get("pid"):
                    self.engine_pgids.add(status["pid"])
                return status
            time.sleep(1)
        raise AssertionError(f"timed out waiting for {what}; stderr: {self.stderr_path.read_text()[-2000:]}")


def start_up(
    profile_path: Path, control_port: int, log_dir: Path, stderr_path: Path
) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "kvtune.cli",
        "up",
        str(profile_path),
        "--control-port",
        str(control_port),
        "--log-dir",
        str(log_dir),
        "--stop-grace",
        "20",
    ]
    return subprocess.Popen(
        argv, stdout=stderr_path.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        profile = write_test_profile(tmp_path / "p.yaml", port=port)
        result = subprocess.run(
            [sys.executable, "-m", "kvtune.cli", "up", str(profile), "--control-port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert (
        f"engine 'cpu-smollm2' (profile {profile}: port): port {port} on 127.0.0.1 is already in use"
        in " ".join(result.stderr.split())
    )
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def up_run(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpRun]:
    folder = tmp_path_factory.mktemp("up")
    (folder / "system-prompt.txt").write_text(WARM_SYSTEM_PROMPT)
    profile = write_test_profile(folder / "warm.yaml", name="warm", warmup=[{"file": "system-prompt.txt"}])
    ARTIFACTS.mkdir(exist_ok=True)
    control_port = free_port()
    stderr_path = ARTIFACTS / "kvtune-up.log"
    proc = start_up(profile, control_port, ARTIFACTS / "up-logs", stderr_path)
    run = UpRun(proc, f"http://127.0.0.1:{control_port}", stderr_path, set())
    try:
        yield run
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=120)
        for pgid in run.engine_pgids | {proc.pid}:
            for pid in group_members(pgid):
                os.kill(pid, signal.SIGKILL)


def assert_warmed(url: str, http: httpx.Client, model_path: str) -> CacheCounters:
    """Before any user request, the engine's counters show the warm-up prompt, and only it, was looked up.

    The engine process is new, so its counters started at zero; this fails if no warm-up was sent.
    """
    shared = shared_prefix_tokens(model_path, WARMUP_CHAT, USER_CHAT)
    assert shared >= 1500
    counters = CacheCounters(queries=0.0, hits=0.0).after(url, http, shared)
    assert counters.hits == 0, "nothing preceded the warm-up, so nothing could be found cached"
    return counters


@pytest.mark.engine
def test_warmup_fills_the_prefix_cache(up_run: UpRun, model_path: str) -> None:
    status = up_run.wait_for(lambda s: s["state"] == "ready", 600, "engine ready")
    assert status["warmup_done"] is True
    capacity = status["kv_capacity"]
    assert capacity["tokens"] > 0
    # The control API says when this host made the profile fall back from fp8 KV, and the engine's own
    # report of its KV dtype agrees, as does vLLM's rule for this CPU.
    if vllm_keeps_fp8_kv():
        assert status["host_note"] is None and capacity["cache_dtype"] == "fp8", status
    else:
        assert capacity["cache_dtype"] == "auto", status
        assert status["host_note"] is not None and status["host_note"].startswith(
            "kv_cache_dtype fp8 -> auto: vLLM keeps an fp8 KV cache on CPU only with AVX-512 or AMX"
        )
    block = capacity["block_size"]
    with httpx.Client(timeout=300) as http:
        warmed = assert_warmed(status["url"], http, model_path)
        # The first user's request finds the warmed system prompt cached: every whole block of it.
        first = openai_client.stream_chat(http, status["url"], MODEL, USER_CHAT, max_tokens=4)
        assert first.prompt_tokens is not None
        after = warmed.after(status["url"], http, first.prompt_tokens)
    shared = shared_prefix_tokens(model_path, WARMUP_CHAT, USER_CHAT)
    assert after.hits - warmed.hits == (shared // block) * block, (after, shared, block)


@pytest.mark.engine
def test_killed_engine_is_restarted_and_serves(up_run: UpRun, model_path: str) -> None:
    before = up_run.wait_for(lambda s: s["state"] == "ready", 600, "engine ready")
    os.kill(before["pid"], signal.SIGKILL)
    after = up_run.wait_for(
        lambda s: s["state"] == "ready" and s["restarts"] == 1 and s["pid"] != before["pid"],
        600,
        "engine restarted",
    )
    assert after["warmup_done"] is True
    assert after["last_exit_code"] == -signal.SIGKILL
    with httpx.Client(timeout=120) as http:
        # A new engine process, warmed again before anyone asked it anything.
        assert_warmed(after["url"], http, model_path)
        answer = openai_client.chat(
            http,
            after["url"],
            MODEL,
            [{"role": "user", "content": "What is the capital of France?"}],
        )
    assert "Paris" in answer
    assert not group_members(before["pid"]), "the killed engine's children must be stopped too"


@pytest.mark.engine
def test_sigterm_drains_stops_everything_and_exits_0(up_run: UpRun) -> None:
    status = up_run.wait_for(lambda s: s["state"] == "ready", 600, "engine ready")
    assert group_members(status["pid"]), "the engine runs in its own process group"
    in_flight: dict[str, Any] = {}

    def long_request() -> None:
        messages = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
        with httpx.Client(timeout=300) as http:
            try:
                in_flight["result"] = openai_client.stream_chat(
                    http, status["url"], MODEL, messages, max_tokens=48, extra={"ignore_eos": True}
                )
            except httpx.HTTPError as exc:
                in_flight["error"] = exc

    sender = threading.Thread(target=long_request)
    sender.start()
    # The stop comes while the engine is generating the request: wait until it says so, not for a time.
    deadline = time.monotonic() + 120
    while metrics.total(metrics.scrape(status["url"]), metrics.REQUESTS_RUNNING) < 1:
        assert time.monotonic() < deadline and sender.is_alive(), f"the request never ran: {in_flight}"
        time.sleep(0.05)
    os.killpg(up_run.proc.pid, signal.SIGTERM)
    assert up_run.proc.wait(timeout=120) == 0
    sender.join(timeout=60)
    assert "error" not in in_flight, f"a request in flight was cut off: {in_flight.get('error')}"
    assert in_flight["result"].completion_tokens == 48, "the engine drained the request before stopping"
    leftovers = {pgid: group_members(pgid) for pgid in up_run.engine_pgids | {up_run.proc.pid}}
    assert all(not members for members in leftovers.values()), json.dumps(leftovers)
    assert "All engines stopped (SIGTERM)" in up_run.stderr_path.read_text()
