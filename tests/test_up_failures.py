"""`kvtune up` never hangs: whatever ends an engine's thread ends that engine as failed, with its reason,
and `kvtune up` exits 1 within seconds.

The failures are injected at the seam where they happen for real (the engine's process start, its metrics,
its warm-up): a Python wrapper patches one function, then runs the real `kvtune up` command line.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml

from kvtune.engine import Engine, free_port
from kvtune.profile import EngineProfile
from kvtune.supervisor import RestartPolicy, State, Supervisor
from tests.conftest import default_profile_data

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
