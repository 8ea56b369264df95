"""Stopping a process and everything it started: its process group, signalled, waited for, then killed.

Every helper here expects a process started in a session (or group) of its own (`start_new_session=True`),
so that its pid is its group id and its children (vLLM's engine core and workers, Locust's workers) share
that group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# After SIGKILL only the kernel has work left; this long is spent waiting for it to finish.
KILL_WAIT_S = 10.0


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send `sig` to every process of a group; a group that is already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, read from /proc.

    Zombies are skipped on purpose: in a container whose init does not reap, a dead child would
    otherwise look alive forever.
    """
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            members.append(int(stat.parent.name))
    return members


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
