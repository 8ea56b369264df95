"""Locust's web UI, seen in a real headless Chromium, shows the custom TTFT/ITL request types."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.browser import locust_stats_rows, open_browser, wait_for_locust_requests
from tests.conftest import ARTIFACTS, REPO, free_port

PROBE_LOCUSTFILE = REPO / "loadtests" / "_webui_probe.py"
LOCUST = Path(sys.executable).with_name("locust")


class _OkHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"ok\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def ok_server() -> Iterator[str]:
    """A tiny HTTP server on a free port answering every GET with 200; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OkHandler)
    thread = threading.Thread(target=server.serve_forever, name="ok-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


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
        "-f", str(PROBE_LOCUSTFILE),
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


def test_locust_web_ui_shows_custom_request_types() -> None:
    screenshot = ARTIFACTS / "locust-webui.png"
    log_path = ARTIFACTS / "locust-webui.log"
    with ok_server() as host, locust_web_ui(host, log_path) as url, open_browser() as page:
        page.open(url)
        try:
            page.wait_for_text("STATISTICS")
            rows = wait_for_locust_requests(page, ["TTFT", "ITL"], timeout_s=30)
        finally:
            page.screenshot(screenshot)

        by_type = {row["Type"]: row for row in rows}
        for request_type in ("TTFT", "ITL", "GET"):
            row = by_type[request_type]
            assert int(row["# Requests"]) > 0, row
            assert row["# Fails"] == "0", row
        assert by_type["TTFT"]["Name"] == by_type["ITL"]["Name"] == "probe"
        assert any(row["Name"] == "Aggregated" for row in locust_stats_rows(page))

    assert screenshot.stat().st_size > 10_000
    log = log_path.read_text()
    assert "Traceback" not in log, log
    assert "Shutting down (exit code 0)" in log, log  # SIGTERM took Locust's own shutdown path
