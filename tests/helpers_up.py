"""`kvtune up` as a user runs it, for the tests that need its engines: started, waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtune.processes import stop_group
from kvtune.profile import EngineProfile
from tests.helpers import ARTIFACTS


@dataclass(frozen=True)
class KeyedEngine:
    """An engine `kvtune up` runs with credentials: refuses /v1 requests without the key."""

    profile: EngineProfile
    control_url: str
    folder: Path  # the profile and the engine logs: kvtune's own files for this engine

    @property
    def url(self) -> str:
        return self.profile.url


def engines_ready(control_url: str, count: int = 1) -> bool:
    """COUNT engines `kvtune up` runs are all ready, by its control API's /health (which takes no key)."""
    try:
        health = httpx.get(f"{control_url}/health", timeout=5).json()
    except httpx.HTTPError:
        return False
    return bool(health["ok"]) and health["engines"] >= count


@contextlib.contextmanager
def running_up(
    up_args: list[str],
    log_name: str,
    engines: int = 1,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvtune up UP_ARGS...` as a user runs it (its output in test-artifacts/LOG_NAME), until ENGINES
    engines are ready by its control API (UP_ARGS name --control-port); stopped by SIGTERM, its own stop
    path, then its process group."""
    control_port = up_args[up_args.index("--control-port") + 1]
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / log_name
    argv = [sys.executable, "-m", "kvtune.cli", "up", *up_args]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env=os.environ | (env or {}), start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while not engines_ready(f"http://127.0.0.1:{control_port}", engines):
            assert proc.poll() is None, f"kvtune up exited early: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engines not ready: {log.read_text()[-3000:]}"
            time.sleep(1.0)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)  # kvtune up's own stop: drains and stops the engines' groups
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
        stop_group(proc, grace_s=5)
