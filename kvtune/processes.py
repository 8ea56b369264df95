"""Stopping a process and everything it started: its process group, signalled, waited for, then killed.

Every helper here expects a process started in a session (or group) of its own (`start_new_session=True`),
so that its pid is its group id and its children (vLLM's engine core and workers, Locust's workers) share
that group. `stopping_new_groups` ends such groups when a stop is asked for (stop_request.py), so that the
code waiting on them sees them end and returns through its ordinary paths, with nothing raised into it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.stop_request import StopFlag

log = logging.getLogger(__name__)

# After SIGKILL only the kernel has work left; this long is spent waiting for it to finish.
KILL_WAIT_S = 10.0
# A group asked to stop by `stopping_new_groups` is killed this long after SIGTERM: an engine asked to stop
# mid-trial has nothing worth draining, and the sweep's user is waiting for the prompt.
STOP_GRACE_S = 10.0


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to every process of a group; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass(frozen=True)
class _Stat:
    """The fields of /proc/PID/stat this module reads."""

    pid: int
    state: str
    parent: int
    group: int


def _processes() -> Iterator[_Stat]:
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name, in parentheses, may hold spaces and parentheses: split after the last one.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            yield _Stat(int(stat.parent.name), fields[0], int(fields[1]), int(fields[2]))
        except (OSError, IndexError, ValueError):
            continue  # ended while being read


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc.

    Zombies are skipped on purpose: in a container whose init does not reap, a dead child would
    otherwise look alive forever.
    """
    return [p.pid for p in _processes() if p.group == pgid and p.state not in ("Z", "X")]


def child_groups(parent: int | None = None) -> set[int]:
    """The process groups led by a child of PARENT (default: this process), other than PARENT's own: each
    engine, Locust process or server it started in a session of its own."""
    parent = os.getpid() if parent is None else parent
    own = os.getpgid(parent)
    return {p.pid for p in _processes() if p.parent == parent and p.group == p.pid != own}


@contextmanager
def stopping_new_groups(stop: StopFlag, grace_s: float = STOP_GRACE_S, poll_s: float = 0.1) -> Iterator[None]:
    """Inside, once STOP is set: SIGTERM every group a child of this process leads that was not there on
    entry, and SIGKILL what is left of it GRACE_S later; groups started after the stop get the same, until
    the block ends.

    A watcher thread does it, so nothing runs in the code inside the block: that code sees its engine or
    Locust end (a failed readiness poll, a refused connection) and returns or raises as it would for any
    process that died. Groups there before the block (a dashboard serving the whole run) are left alone.
    """
    before = child_groups()
    done = threading.Event()
    watcher = threading.Thread(
        target=_stop_new_groups,
        args=(stop, before, done, grace_s, poll_s),
        name="stop-new-groups",
        daemon=True,
    )
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def _stop_new_groups(
    stop: StopFlag, before: set[int], done: threading.Event, grace_s: float, poll_s: float
) -> None:
    terminated: dict[int, float] = {}  # group -> when it was sent SIGTERM
    killed: set[int] = set()
    while not done.wait(poll_s):
        if not stop.is_set():
            continue
        now = time.monotonic()
        for pgid in sorted(child_groups() - before - terminated.keys()):
            log.info("stop asked: ending process group %d", pgid)
            signal_group(pgid, signal.SIGTERM)
            terminated[pgid] = now
        for pgid, since in terminated.items():
            if pgid not in killed and now - since >= grace_s and group_members(pgid):
                log.warning("process group %d: still running %.0f s after SIGTERM, killing", pgid, grace_s)
                signal_group(pgid, signal.SIGKILL)
                killed.add(pgid)


def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM a process group no Popen of ours leads (one a child started in a session of its own), wait
    up to `grace_s` for it to end, then SIGKILL what is left."""
    signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid):
        signal_group(pgid, signal.SIGKILL)


def wait_group_gone(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Reap the leader and wait for the rest of its group; True when nothing of it is left."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()
        if not group_members(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def reap_group(proc: subprocess.Popen[Any], grace_s: float, label: str = "process group") -> int:
    """Wait up to `grace_s` for a signalled group to end, SIGKILL what is left, and reap the leader.

    Returns the leader's exit code (negative: the signal that ended it).
    """
    if not wait_group_gone(proc, grace_s):
        log.warning("%s: still running after %.0f s, killing", label, grace_s)
        signal_group(proc.pid, signal.SIGKILL)
        wait_group_gone(proc, KILL_WAIT_S)
    return proc.wait()


def stop_groups(procs: Sequence[subprocess.Popen[Any]], grace_s: float) -> list[int]:
    """SIGTERM every group at once, give them `grace_s` in all to end, then SIGKILL the rest; exit codes."""
    for proc in procs:
        signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    return [reap_group(proc, max(0.0, deadline - time.monotonic()), f"pid {proc.pid}") for proc in procs]


def stop_group(proc: subprocess.Popen[Any], grace_s: float) -> int:
    """SIGTERM the process group, wait up to `grace_s`, SIGKILL what is left, reap; the leader's exit code."""
    return stop_groups([proc], grace_s)[0]
