"""Locust's web UI, in a real headless Chromium, on a real engine: the header and the Aggregated row count
requests only, and TTFT and ITL have a tab of their own."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvtune.engine import Engine, free_port
from kvtune.processes import stop_group
from tests.browser import (
    LocustSnapshot,
    locust_snapshot,
    open_browser,
    open_locust_tab,
    wait_for_locust_requests,
)
from tests.helpers import ARTIFACTS, REPO

LOCUSTFILE = REPO / "loadtests" / "shared_prefix.py"
LOCUST = Path(sys.executable).with_name("locust")


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
        stop_group(process, grace_s=10.0)


def current_rps(row: dict[str, str]) -> float:
    return float(row["Current RPS"].replace(",", ""))


def under_load(snapshot: LocustSnapshot) -> bool:
    posts = [row for row in snapshot.rows if row.get("Type") == "POST"]
    return (
        bool(posts) and float(snapshot.header.get("RPS", "0") or 0) > 0 and sum(map(current_rps, posts)) > 0
    )


@pytest.mark.engine
def test_locust_header_counts_requests_and_ttft_itl_have_their_own_tab(default_engine: Engine) -> None:
    screenshot = ARTIFACTS / "locust-webui.png"
    log_path = ARTIFACTS / "locust-webui.log"
    with locust_web_ui(default_engine.url, log_path) as url, open_browser() as page:
        page.open(url)
        try:
            page.wait_for_text("STATISTICS")
            wait_for_locust_requests(page, ["POST"], timeout_s=120)
            snapshot = page.wait_until(locust_snapshot, under_load, "a non-zero RPS in the header", 120)
            open_locust_tab(page, "TTFT / ITL")
            timings = page.wait_until(
                lambda p: p.table_rows("table"),
                lambda rows: {"TTFT", "ITL"} <= {r.get("Type") for r in rows if r.get("Samples", "0") != "0"},
                "TTFT and ITL rows with samples",
            )
        finally:
            page.screenshot(screenshot)
        csv_download = httpx.get(f"{url}kvtune/token-latency.csv", timeout=10)

    # Header and table from the same moment: the header's RPS is the POST rows' rate, not tokens' timings.
    posts = [row for row in snapshot.rows if row["Type"] == "POST"]
    (aggregated,) = [row for row in snapshot.rows if row["Name"] == "Aggregated"]
    assert {row["Type"] for row in snapshot.rows} == {"POST", ""}, snapshot.rows
    assert float(snapshot.header["RPS"]) == pytest.approx(sum(map(current_rps, posts)), abs=0.011), snapshot
    assert aggregated["# Requests"] == posts[0]["# Requests"] and aggregated["# Fails"] == "0"
    assert snapshot.header["Failures"] == "0%"

    by_type = {row["Type"]: row for row in timings}
    for request_type in ("TTFT", "ITL"):
        row = by_type[request_type]
        assert row["Name"] == "shared_prefix" and int(row["Samples"].replace(",", "")) > 0, row
        assert float(row["Median (ms)"].replace(",", "")) > 0, row
    assert csv_download.status_code == 200 and csv_download.text.startswith("Type,Name,Samples,Median (ms)")
    assert {line.split(",")[0] for line in csv_download.text.splitlines()[1:]} == {"TTFT", "ITL"}

    assert screenshot.stat().st_size > 10_000
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert "Shutting down (exit code 0)" in log, log  # SIGTERM took Locust's own shutdown path
