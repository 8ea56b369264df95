"""`kvtune up` on real engines: warm-up pays, a killed engine comes back, SIGTERM leaves nothing behind."""

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
import yaml

from kvtune import openai_client, platform
from kvtune.engine import Engine, group_members
from tests.conftest import ARTIFACTS, default_profile_data, free_port
from tests.prompts import long_text

WARM_SYSTEM_PROMPT = long_text("warm-up", sentences=170)
USER_TURN = "Which note mentions a falcon?"


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


def write_profile(path: Path, **overrides: Any) -> Path:
    path.write_text(yaml.safe_dump(default_profile_data(**overrides)))
    return path


def test_up_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        profile = write_profile(tmp_path / "p.yaml", port=port)
        result = subprocess.run(
            [sys.executable, "-m", "kvtune.cli", "up", str(profile), "--control-port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert (
        f"engine 'cpu-smollm2' (profile field 'port'): port {port} on 127.0.0.1 is already in use"
        in " ".join(result.stderr.split())
    )
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def up_run(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpRun]:
    folder = tmp_path_factory.mktemp("up")
    (folder / "system-prompt.txt").write_text(WARM_SYSTEM_PROMPT)
    profile = write_profile(folder / "warm.yaml", name="warm", warmup=[{"file": "system-prompt.txt"}])
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


@pytest.mark.engine
def test_warmup_pays(up_run: UpRun, default_engine: Engine) -> None:
    status = up_run.wait_for(lambda s: s["state"] == "ready", 600, "engine ready")
    assert status["warmup_done"] is True
    assert status["kv_capacity"]["tokens"] > 0
    # The control API says when this host made the profile fall back from fp8 KV.
    fp8_problem = platform.cpu_fp8_kv_problem(head_dim=64)
    assert (status["host_note"] is None) == (fp8_problem is None), status["host_note"]
    messages = [{"role": "system", "content": WARM_SYSTEM_PROMPT}, {"role": "user", "content": USER_TURN}]
    with httpx.Client(timeout=300) as http:
        warm = openai_client.stream_chat(http, status["url"], "smollm2-135m", messages, max_tokens=4)
        # Same request, same settings, on an engine that never saw this prompt.
        cold = openai_client.stream_chat(
            http, default_engine.url, default_engine.profile.api_model_name, messages, max_tokens=4
        )
    assert cold.prompt_tokens is not None and cold.prompt_tokens >= 1500
    assert warm.ttft is not None and cold.ttft is not None
    assert warm.ttft <= 0.25 * cold.ttft, f"TTFT warmed {warm.ttft:.2f} s vs unwarmed {cold.ttft:.2f} s"


@pytest.mark.engine
def test_killed_engine_is_restarted_and_serves(up_run: UpRun) -> None:
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
        answer = openai_client.chat(
            http,
            after["url"],
            "smollm2-135m",
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
                    http, status["url"], "smollm2-135m", messages, max_tokens=48, extra={"ignore_eos": True}
                )
            except httpx.HTTPError as exc:
                in_flight["error"] = exc

    sender = threading.Thread(target=long_request)
    sender.start()
    time.sleep(1.5)  # the request is being generated when the stop comes
    os.killpg(up_run.proc.pid, signal.SIGTERM)
    assert up_run.proc.wait(timeout=120) == 0
    sender.join(timeout=60)
    assert "error" not in in_flight, f"a request in flight was cut off: {in_flight.get('error')}"
    assert in_flight["result"].completion_tokens == 48, "the engine drained the request before stopping"
    leftovers = {pgid: group_members(pgid) for pgid in up_run.engine_pgids | {up_run.proc.pid}}
    assert all(not members for members in leftovers.values()), json.dumps(leftovers)
    assert "All engines stopped (SIGTERM)" in up_run.stderr_path.read_text()
