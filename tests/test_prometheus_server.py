"""The local Prometheus `kvtune up --prometheus` runs: real Prometheus, a stand-in /metrics, its lifecycle.

The engine side here is a static /metrics page (a fast test); tests/test_monitoring_real.py scrapes a real
engine through `kvtune up --prometheus`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from kvtune.engine import free_port, port_in_use
from kvtune.observability.prometheus_server import (
    SCRAPE_JOB,
    PrometheusError,
    PrometheusServer,
    ScrapeTarget,
    scrape_config,
)
from tests.helpers import write_test_profile

METRICS = (
    b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
)
RULES = """groups:
- name: test
  rules:
  - alert: AlwaysOn
    expr: vector(1)
"""


class MetricsPage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(METRICS)

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass


@pytest.fixture
def metrics_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), MetricsPage)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def query(url: str, expr: str) -> list[dict[str, object]]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


def test_scrape_config_names_every_engine_and_the_rules(tmp_path: Path) -> None:
    targets = [ScrapeTarget("a", "127.0.0.1", 8000), ScrapeTarget("b", "127.0.0.1", 8001)]
    config = scrape_config(targets, tmp_path / "rules.yaml", 2.0)
    assert config["global"] == {"scrape_interval": "2s", "evaluation_interval": "2s"}
    assert config["rule_files"] == [str(tmp_path / "rules.yaml")]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == SCRAPE_JOB
    assert [(c["targets"], c["labels"]) for c in job["static_configs"]] == [
        (["127.0.0.1:8000"], {"kvtune_engine": "a"}),
        (["127.0.0.1:8001"], {"kvtune_engine": "b"}),
    ]


def test_prometheus_scrapes_evaluates_rules_and_stops(tmp_path: Path, metrics_port: int) -> None:
    port = free_port()
    server = PrometheusServer(
        [ScrapeTarget("stand-in", "127.0.0.1", metrics_port)],
        RULES,
        tmp_path / "prometheus",
        port=port,
        interval_s=0.5,
    )
    with server:
        subprocess.run(["promtool", "check", "config", str(server.folder / "prometheus.yml")], check=True)
        deadline = time.monotonic() + 30
        while not (series := query(server.url, "vllm:num_requests_running")):
            assert time.monotonic() < deadline, (server.folder / "prometheus.log").read_text()[-2000:]
            time.sleep(0.3)
        labels = series[0]["metric"]
        assert isinstance(labels, dict)
        assert labels["job"] == SCRAPE_JOB and labels["kvtune_engine"] == "stand-in"
        while not query(server.url, 'ALERTS{alertname="AlwaysOn"}'):
            assert time.monotonic() < deadline, "the rules file was not loaded"
            time.sleep(0.3)
        # Whoever reaches the port cannot stop or reconfigure it: the lifecycle endpoints are off.
        for endpoint in ("/-/quit", "/-/reload"):
            refused = httpx.post(f"{server.url}{endpoint}", timeout=10)
            assert refused.status_code == 403 and "Lifecycle API is not enabled" in refused.text
        assert query(server.url, "up")
    assert not port_in_use("127.0.0.1", port)


def test_a_refused_config_is_an_error_with_prometheus_own_words(tmp_path: Path) -> None:
    server = PrometheusServer([], "groups: [{name: broken, rules: [{alert: X, expr: 'rate('}]}]", tmp_path)
    server.port = free_port()
    with pytest.raises(PrometheusError, match="exited with code"):
        server.start()
    assert not port_in_use("127.0.0.1", server.port)


def test_up_refuses_prometheus_when_the_binary_is_missing(tmp_path: Path) -> None:
    profile = write_test_profile(tmp_path / "p.yaml")
    python_dir = str(Path(sys.executable).parent)
    result = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "up", str(profile), "--prometheus", "--log-dir", str(tmp_path)],
        capture_output=True, text=True, env=os.environ | {"PATH": python_dir}, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--prometheus: `prometheus` is not on PATH" in " ".join(result.stderr.split())
    assert "make sysdeps" in result.stderr
    assert not list(tmp_path.glob("*.log")), "refused before any engine started"
