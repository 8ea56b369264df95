"""Locust's web UI, in a real headless Chromium, shows TTFT and ITL rows of a load test on a real engine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvtune.engine import Engine
from tests.browser import locust_stats_rows, open_browser, wait_for_locust_requests
from tests.conftest import ARTIFACTS, REPO, free_port

LOCUSTFILE = REPO / "loadtests" / "shared_prefix.py"
LOCUST = Path(sys.executable).with_name("locust")


def stop_group(process: subprocess.Popen[str], grace_s: float = 10.0) -> None:
    """SIGTERM to the process group, SIGKILL after the grace period; no group member outlives the test."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)
    # Also when the leader exited: children of its group may linger.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=5)


@contextmanager
def locust_web_ui(host: str, log_path: Path, timeout_s: float = 60.0) -> Iterator[str]:
    """Locust with its web UI, auto-started against `host`; yields the UI's URL once it answers."""
    web_port = free_port()
    argv = [
        str(LOCUST),
        "-f", str(LOCUSTFILE),
        "--system-tokens", "128", "--user-tokens", "32", "--max-tokens", "8",
        "--host", host,
        "--web-host", "127.0.0.1",
        "--web-port", str(web_port),
        "--autostart",
        "--users", "2",
        "--spawn-rate", "2",
        "--run-time", "60s",
    ]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=REPO, start_new_session=True
        )
    url = f"http://127.0.0.1:{web_port}/"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"locust exited with {process.returncode}:\n{log_path.read_text()}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"locust web UI not up after {timeout_s}s:\n{log_path.read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        stop_group(process)


@pytest.mark.engine
def test_locust_web_ui_shows_ttft_and_itl_rows(default_engine: Engine) -> None:
    screenshot = ARTIFACTS / "locust-webui.png"
    log_path = ARTIFACTS / "locust-webui.log"
    with locust_web_ui(default_engine.url, log_path) as url, open_browser() as page:
        page.open(url)
        try:
            page.wait_for_text("STATISTICS")
            rows = wait_for_locust_requests(page, ["TTFT", "ITL"], timeout_s=120)
        finally:
            page.screenshot(screenshot)

        by_type = {row["Type"]: row for row in rows}
        for request_type in ("TTFT", "ITL", "POST"):
            row = by_type[request_type]
            assert int(row["# Requests"]) > 0, row
            assert row["# Fails"] == "0", row
        assert by_type["TTFT"]["Name"] == by_type["ITL"]["Name"] == "shared_prefix"
        assert any(row["Name"] == "Aggregated" for row in locust_stats_rows(page))

    assert screenshot.stat().st_size > 10_000
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert "Shutting down (exit code 0)" in log, log  # SIGTERM took Locust's own shutdown path
