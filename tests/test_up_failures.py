"""`kvtune up` never hangs: whatever ends an engine's thread ends that engine as failed, with its reason,
and `kvtune up` exits 1 within seconds.

The failures are injected at the seam where they happen for real (the engine's process start, its metrics,
its warm-up): a Python wrapper patches one function, then runs the real `kvtune up` command line.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.cli import build_parser
from kvtune.commands import up
from kvtune.engine import Engine, free_port
from kvtune.observability.prometheus_server import PrometheusError
from kvtune.profile import EngineProfile
from kvtune.supervisor import RestartPolicy, State, Supervisor
from tests.helpers import default_profile_data

FAKE = str(Path(__file__).with_name("fake_engine.py"))


def run_up(tmp_path: Path, module: str, attribute: str, raised: str) -> tuple[int, str, float]:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(default_profile_data(name="doomed")))
    wrapper = textwrap.dedent(f"""
        import importlib, sys
        target = importlib.import_module({module!r})
        def broken(*args, **kwargs):
            raise {raised}
        setattr(target, {attribute!r}, broken)
        from kvtune.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", wrapper, "up", str(profile), "--log-dir", str(tmp_path / "logs"),
         "--control-port", str(free_port())],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr, time.monotonic() - started


def test_a_failing_process_start_ends_up_with_exit_1_and_the_reason(tmp_path: Path) -> None:
    # Popen refuses an environment it cannot pass (an '=' or NUL in a name): not an EngineError.
    code, output, seconds = run_up(
        tmp_path, "subprocess", "Popen", "ValueError('illegal environment variable name')"
    )
    assert code == 1, output
    flat = " ".join(output.split())
    assert "engine doomed failed for good: ValueError: illegal environment variable name" in flat, flat
    assert "Traceback" not in output
    assert seconds < 30, f"took {seconds:.0f} s"


def test_a_warm_up_file_gone_after_loading_fails_the_engine_not_the_wait(tmp_path: Path) -> None:
    """The supervisor's thread finds the file gone (the document reader's error); waiters wake and the engine
    is FAILED."""
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("A shared system prompt.")
    profile = EngineProfile(
        name="fake", device="cpu", model="fake-model", port=free_port(), warmup=[{"file": str(prefix)}]
    )
    prefix.unlink()
    command = [sys.executable, FAKE, "--port", str(profile.port), "--served-model-name", "fake-model"]
    engine = Engine(profile, tmp_path / "fake.log", command=command, ready_timeout=30, stop_grace=5)
    supervisor = Supervisor([engine], RestartPolicy(max_restarts=3, backoff_initial=0.1))
    supervisor.start()
    try:
        started = time.monotonic()
        supervisor.wait_all_settled(threading.Event())
        assert time.monotonic() - started < 30
        (status,) = supervisor.statuses()
        assert status.state == State.FAILED
        assert status.restarts == 0, "a missing file is not fixed by restarting the engine"
        assert status.last_failure is not None and "no such file; check the path" in status.last_failure
        assert str(prefix) in status.last_failure
    finally:
        supervisor.stop()
    assert not engine.is_running()


@pytest.mark.engine
def test_ask_with_an_engine_that_cannot_start_says_why(tmp_path: Path) -> None:
    not_a_model = tmp_path / "empty-model"
    not_a_model.mkdir()
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(default_profile_data(name="hopeless", model=str(not_a_model))))
    result = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "ask", str(profile), "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    flat = " ".join(output.split())
    assert "error: engine 'hopeless' exited with code" in flat and "before it was ready" in flat, flat
    assert "Traceback" not in output


# ---- one cleanup path: whatever has started is stopped when a later start fails --------------------------


class Recorder:
    """Stands in for each thing `kvtune up` starts, writing "start X" and "stop X" in the order they run."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.failing: set[str] = set()

    def part(self, name: str, **attributes: Any) -> Any:
        recorder = self

        class Part:
            def __init__(self, *_args: Any, **_kwargs: Any) -> None:
                self.__dict__.update(attributes)

            def start(self) -> None:
                recorder.calls.append(f"start {name}")
                if name in recorder.failing:
                    raise attributes.get("error", RuntimeError)(f"{name} cannot start")

            def stop(self) -> None:
                recorder.calls.append(f"stop {name}")

            def statuses(self) -> list[Any]:  # the supervisor's: every engine failed for good
                return [
                    types.SimpleNamespace(name="e", state=State.FAILED, last_failure="died", kv_capacity=None)
                ]

            def wait_all_settled(self, _stop: threading.Event) -> None:
                pass

            def wait_seen_ready(self, _names: list[str]) -> list[str]:
                return []

        return Part


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    calls = Recorder()
    monkeypatch.setattr(up, "resolve_model", lambda model, _cache_dir: model)  # no model preparation
    monkeypatch.setattr(up, "Engine", lambda *_args, **_kwargs: None)
    monkeypatch.setattr(up, "ControlServer", calls.part("control", url="http://127.0.0.1:1"))
    monkeypatch.setattr(up, "Supervisor", calls.part("engines"))
    prometheus = calls.part(
        "prometheus", binary="sh", host="127.0.0.1", port=free_port(), url="http://p", folder=Path("p"),
        error=PrometheusError,
    )  # fmt: skip
    monkeypatch.setattr(up, "PrometheusServer", prometheus)
    router = calls.part("router", url="http://r")
    monkeypatch.setattr(up, "fleet_router", lambda *_args: router())
    return calls


def run_main(tmp_path: Path) -> int:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(default_profile_data(name="one")))
    argv = ["up", str(profile), "--log-dir", str(tmp_path / "logs"), "--control-port", str(free_port())]
    argv += ["--router", "round_robin", "--router-port", str(free_port()), "--prometheus"]
    argv += ["--prometheus-port", str(free_port())]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code: int = up.main(build_parser(argv).parse_args(argv))
    finally:
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers, "signal handlers put back"
    return code


@pytest.mark.parametrize(
    ("failing", "started"),
    [
        ("prometheus", ["start prometheus"]),
        ("router", ["start prometheus", "start control", "start engines", "start router"]),
    ],
)
def test_a_failed_start_stops_what_started_before_it_newest_first(
    tmp_path: Path, recorder: Recorder, failing: str, started: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    recorder.failing.add(failing)
    assert run_main(tmp_path) == 1
    # The failing one is stopped too: a router may be listening late, a Prometheus process half up.
    assert recorder.calls == started + [f"stop {call.split()[1]}" for call in reversed(started)]
    assert f"{failing} cannot start" in " ".join(capsys.readouterr().err.split())


def test_an_unexpected_error_at_a_start_still_stops_what_started(tmp_path: Path, recorder: Recorder) -> None:
    recorder.failing.add("engines")  # not one of the errors up knows: it propagates, after the stops
    with pytest.raises(RuntimeError, match="engines cannot start"):
        run_main(tmp_path)
    assert recorder.calls == [
        "start prometheus",
        "start control",
        "start engines",
        "stop control",
        "stop prometheus",
    ]


def test_the_normal_end_stops_everything_newest_first(tmp_path: Path, recorder: Recorder) -> None:
    assert run_main(tmp_path) == 1  # every engine failed for good
    starts = ["start prometheus", "start control", "start engines", "start router"]
    assert recorder.calls == [*starts, "stop router", "stop engines", "stop control", "stop prometheus"]
