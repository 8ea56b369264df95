"""Locust as a user runs it on the repository's locustfiles: headless, short, small answers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO

LOCUST = Path(sys.executable).with_name("locust")


def run_locust(
    locustfile: str, host: str, *extra: str, seconds: int = 15, users: int = 2
) -> subprocess.CompletedProcess[str]:
    argv = [str(LOCUST), "-f", str(REPO / "loadtests" / f"{locustfile}.py"), "--host", host, "--headless",
            "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--max-tokens", "8",
            "--stop-timeout", "120", *extra]  # fmt: skip
    # --stop-timeout: requests in flight when the time is up still finish and count, however slow the host.
    return subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 360, check=False, cwd=REPO)
