"""Controller fault handling, fast: a fake server that crashes or fails to start stands in for vLLM."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtune.control_api import ControlServer
from kvtune.engine import Engine, EngineError, free_port, group_members
from kvtune.profile import EngineProfile
from kvtune.supervisor import RestartPolicy, State, Supervisor

FAKE = str(Path(__file__).with_name("fake_engine.py"))
FAST = RestartPolicy(max_restarts=2, backoff_initial=0.1, backoff_max=0.2)
# The fake engine, with each request's method, path and body size appended to a file (argv[1]): the
# proof of what the controller really sent it.
RECORDING_FAKE = """
import runpy, sys
from http.server import BaseHTTPRequestHandler
log_path, sys.argv = sys.argv[1], sys.argv[2:]
parse = BaseHTTPRequestHandler.parse_request
def recorded(self):
    ok = parse(self)
    if ok:
        with open(log_path, "a") as log:
            log.write(f"{self.command} {self.path} {self.headers.get('Content-Length', 0)}\\n")
    return ok
BaseHTTPRequestHandler.parse_request = recorded
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def fake_engine(
    tmp_path: Path, *fake_args: str, name: str = "fake", warmup: list[dict[str, str]] | None = None
) -> Engine:
    profile = EngineProfile(
        name=name, device="cpu", model="fake-model", port=free_port(), warmup=warmup or []
    )
    command = [
        sys.executable,
        "-c",
        RECORDING_FAKE,
        str(requests_path(tmp_path, name)),
        FAKE,
        "--port",
        str(profile.port),
        "--served-model-name",
        "fake-model",
        *fake_args,
    ]
    return Engine(profile, tmp_path / f"{name}.log", command=command, ready_timeout=30, stop_grace=5)


def requests_path(tmp_path: Path, name: str) -> Path:
    return tmp_path / f"{name}.requests"


def posts(tmp_path: Path, name: str) -> list[tuple[str, int]]:
    """(path, body bytes) of every POST the fake engine `name` received."""
    path = requests_path(tmp_path, name)
    lines = path.read_text().splitlines() if path.exists() else []
    return [(words[1], int(words[2])) for words in map(str.split, lines) if words[0] == "POST"]


def wait_until(predicate: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_start_failure_is_reported_with_vllms_reason(tmp_path: Path) -> None:
    engine = fake_engine(tmp_path, "--fail-start", "No common block size for 16")
    started = time.monotonic()
    with pytest.raises(
        EngineError, match=r"exited with code 1 before it was ready: ValueError: No common block"
    ):
        engine.__enter__()
    assert time.monotonic() - started < 20, "a dead process must fail fast, not wait for the deadline"


def test_engine_context_manager_leaves_no_process(tmp_path: Path) -> None:
    with fake_engine(tmp_path) as engine:
        pgid = engine.pid
        assert pgid is not None and group_members(pgid)
    assert not group_members(pgid)


def test_crashing_engine_is_restarted_then_given_up(tmp_path: Path) -> None:
    supervisor = Supervisor([fake_engine(tmp_path, "--die-after", "1.0")], FAST)
    supervisor.start()
    try:
        wait_until(lambda: supervisor.statuses()[0].state == State.FAILED, timeout=60)
        status = supervisor.statuses()[0]
        assert status.restarts == 2
        assert status.last_exit_code == 3
        assert "injected crash" in Path(status.log_path).read_text()
    finally:
        supervisor.stop()
    assert supervisor.statuses()[0].state == State.FAILED


def test_control_api_reports_engines(tmp_path: Path) -> None:
    system_prompt = "You answer questions about the lighthouse logbook. " * 40  # ~2 KB
    warmed = fake_engine(tmp_path, name="a", warmup=[{"text": system_prompt}])
    supervisor = Supervisor([warmed, fake_engine(tmp_path, name="b")], FAST)
    control = ControlServer(supervisor, "127.0.0.1", free_port())
    control.start()
    supervisor.start()
    try:
        wait_until(lambda: all(s.state == State.READY for s in supervisor.statuses()))
        wait_until(lambda: httpx.get(f"{control.url}/health").status_code == 200)
        engines = httpx.get(f"{control.url}/engines").json()
        assert [e["name"] for e in engines] == ["a", "b"]
        assert engines[0]["kv_capacity"] == {
            "cache_dtype": "auto",
            "block_size": 32,
            "num_blocks": 10,
            "tokens": 320,
            "prefix_caching": True,
        }
        assert engines[0]["warmup_done"] is True and engines[0]["pid"]
        # The warm-up really reached engine a: one chat request carrying the system prompt; b got none.
        [(path, size)] = posts(tmp_path, "a")
        assert path == "/v1/chat/completions" and size > len(system_prompt)
        assert posts(tmp_path, "b") == []
        assert engines[1]["warmup_done"] is None, "b has no warm-up to send"
        assert httpx.get(f"{control.url}/health").json() == {"ok": True, "engines": 2}
        assert httpx.get(f"{control.url}/engines/missing").status_code == 404
        pids = [e["pid"] for e in engines]
    finally:
        supervisor.stop()
        control.stop()
    assert all(not group_members(pid) for pid in pids)
    assert {s.state for s in supervisor.statuses()} == {State.STOPPED}
