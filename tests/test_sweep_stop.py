"""SIGINT and SIGTERM stop `kvtune sweep` without raising inside it: finished trials kept, engines ended,
exit 130, the resume command printed, no traceback, within a bound.

The sweep runs as a user runs it, in its own process (tests/sweep_stop_child.py: the CLI, Rich's progress,
logging), with scripted trials whose engine is a real process group; the signal comes at a random moment
of the search. The stop flag and the group stopper are also tested alone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from rich.console import Console

from kvtune.commands import sweep_parallel
from kvtune.processes import child_groups, end_group, group_members, stopping_new_groups
from kvtune.stop_request import StopRequest, requested_by_signals
from kvtune.sweep import run_dir
from tests import sweep_stop_child as child
from tests.helpers import REPO
from tests.helpers_sweep import SCRIPTED_SPEC

# Three configs (two on a host that prunes 64 MiB) x three repeats of TRIAL_S each: the signal, within
# the first SIGNAL_WITHIN_S of the first trial, falls inside the search.
SPEC = SCRIPTED_SPEC | {"repeats": 3}
SIGNAL_WITHIN_S = 2.0
# From the signal to the exit: the trial in hand sees its engine end (0.1 s), the report is drawn (seconds
# on a busy host).
STOP_BOUND_S = 30.0


def _sweep(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    runs = tmp_path / "runs"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sweep_stop_child", str(spec), str(runs)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        # Rich draws its live progress only on a terminal: force it, so its lock is taken all the while.
        env=os.environ
        | {"FORCE_COLOR": "1", "COLUMNS": "120", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"},
    )
    return proc, runs


def _wait_for(folder: Path, pattern: str, proc: subprocess.Popen[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if folder.exists() and any(folder.glob(pattern)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError(f"nothing matched {folder}/{pattern} within {timeout} s")


# Each example is a sweep process (~3 s); shrinking a failure would rerun dozens, so the failing one is shown.
@settings(
    max_examples=4,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    sig=st.sampled_from([signal.SIGINT, signal.SIGTERM]),
    after=st.floats(min_value=0.0, max_value=SIGNAL_WITHIN_S),
)
def test_a_signal_at_any_moment_stops_the_sweep_cleanly(
    tmp_path_factory: pytest.TempPathFactory, sig: signal.Signals, after: float
) -> None:
    tmp_path = tmp_path_factory.mktemp("stop")
    proc, runs = _sweep(tmp_path)
    try:
        _wait_for(runs, f"*/{child.STARTED}", proc, timeout=60)
        time.sleep(after)
        os.kill(proc.pid, sig)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=STOP_BOUND_S)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, (proc.returncode, out, err)
    assert took < STOP_BOUND_S
    assert "Traceback" not in out + err
    assert "resume with" in err and "kvtune sweep --resume" in err
    (run,) = [path for path in runs.iterdir() if not path.is_symlink()]
    summary = json.loads((run / run_dir.SUMMARY_FILE).read_text())
    assert summary["finished"] is False and summary["stopped_because"].startswith("interrupted (")
    trials = sorted((run / "trials").iterdir())
    assert trials, "the first trial had started"
    for folder in trials:
        assert not (folder / child.RAISED_INTO).exists(), f"an exception was raised inside {folder.name}"
        # Every engine is gone (a zombie left to init counts as gone).
        pid = int((folder / child.ENGINE_PID).read_text())
        assert not group_members(pid), f"the engine of {folder.name} still runs"
    # The trial in hand, cut short, is no result; every finished one is kept, as measured.
    kept = run_dir.finished_trials(run)
    assert all(record.status == "done" for record in kept)
    assert len(kept) >= len(trials) - 1
    resumed = run_dir.interrupted_folders(run)
    assert len(resumed) <= 1


def test_the_stop_flag_is_set_by_either_signal_and_restored_after() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with requested_by_signals() as request:
        assert not request.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not request.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs between bytecodes of this thread
        assert request.is_set() and request.describe() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before
    interrupted = StopRequest()
    interrupted.set(signal.SIGINT)
    assert interrupted.describe() == "Ctrl-C"


def test_groups_started_inside_are_ended_on_a_stop_and_those_before_are_not() -> None:
    stop = StopRequest()
    older = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        with stopping_new_groups(stop, grace_s=1.0, poll_s=0.02):
            # One that ignores SIGTERM, as an engine stuck in a kernel call would: killed after the grace.
            stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & wait"], start_new_session=True)
            polite = subprocess.Popen(["sleep", "60"], start_new_session=True)
            assert {stubborn.pid, polite.pid} <= child_groups()
            time.sleep(0.2)
            assert polite.poll() is None  # nothing is stopped before a stop is asked for
            stop.set(signal.SIGINT)
            assert polite.wait(timeout=5) == -signal.SIGTERM
            assert stubborn.wait(timeout=10) == -signal.SIGKILL
            deadline = time.monotonic() + 5
            while group_members(stubborn.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not group_members(stubborn.pid)  # its child too
            late = subprocess.Popen(["sleep", "60"], start_new_session=True)  # started after the stop
            assert late.wait(timeout=5) == -signal.SIGTERM
        assert older.poll() is None
    finally:
        older.kill()
        older.wait()


class _NoneRunning:
    def running(self) -> list[tuple[str, str, str]]:
        return []


def test_the_parallel_parent_stops_watching_its_workers_when_a_stop_is_asked() -> None:
    """`kvtune sweep --parallel`'s parent watches its workers until they end or a stop is asked for; the
    stop is a flag set from the handler, read at the watch's next look (never an exception in the loop)."""
    worker = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        stop = StopRequest()
        timer = threading.Timer(0.3, stop.set, args=(signal.SIGINT,))
        timer.start()
        started = time.monotonic()
        sweep_parallel._watch(_NoneRunning(), [(None, worker, Path())], Console(quiet=True), stop)  # type: ignore[arg-type, list-item]
        assert stop.is_set() and time.monotonic() - started < 5
        assert worker.poll() is None, "the watch only watches: stopping the workers is the caller's"
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()


def test_a_group_no_popen_leads_is_ended_politely_or_killed_after_its_grace() -> None:
    # As `kvtune up`'s engines are to a script that started `kvtune up`: groups known only by their id.
    polite = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & wait"], start_new_session=True)
    try:
        started = time.monotonic()
        end_group(polite.pid, grace_s=5.0)
        assert polite.wait(timeout=5) == -signal.SIGTERM
        assert time.monotonic() - started < 4.0  # gone at SIGTERM: the grace is not waited out
        time.sleep(0.2)  # the trap is set
        end_group(stubborn.pid, grace_s=0.5)
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        deadline = time.monotonic() + 5
        while group_members(stubborn.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_members(stubborn.pid)  # its child too
    finally:
        for proc in (polite, stubborn):
            proc.kill()
            proc.wait()
