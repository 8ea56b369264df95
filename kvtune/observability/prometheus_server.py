"""A local Prometheus for `kvtune up --prometheus`: a generated scrape config, kvtune's alert rules.

Debian's `prometheus` binary (installed by `make sysdeps`) runs in a process group of its own, with its
config, rules and TSDB under one folder, bound to loopback; it is stopped like an engine (SIGTERM to the
group, a grace period, SIGKILL).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import httpx
import yaml

from kvtune.processes import stop_group

log = logging.getLogger(__name__)

DEFAULT_PORT = 9090
SCRAPE_JOB = "kvtune"
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0
INSTALL_HINT = (
    "install it with `make sysdeps` (Debian: `apt-get install prometheus`) or pass --prometheus-bin"
)


class PrometheusError(RuntimeError):
    """Prometheus is missing, would not start, or its config was refused."""


@dataclass(frozen=True)
class ScrapeTarget:
    """One engine Prometheus scrapes: its name becomes the `kvtune_engine` label."""

    name: str
    host: str
    port: int
    worker: str | None = None  # a router worker's index: its `worker` label

    @property
    def labels(self) -> dict[str, str]:
        return {"kvtune_engine": self.name} | ({"worker": self.worker} if self.worker is not None else {})

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def prometheus_duration(seconds: float) -> str:
    """Seconds as Prometheus writes a duration: whole numbers and a unit (`5s`, `500ms`, never `0.5s`)."""
    millis = round(seconds * 1000)
    return f"{millis // 1000}s" if millis % 1000 == 0 else f"{millis}ms"


def scrape_config(targets: list[ScrapeTarget], rules: Path, interval_s: float) -> dict[str, Any]:
    """prometheus.yml: every engine in one job, scraped and rule-evaluated every `interval_s` seconds."""
    interval = prometheus_duration(interval_s)
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": SCRAPE_JOB,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [t.address], "labels": t.labels} for t in targets],
            }
        ],
    }


class PrometheusServer:
    """Prometheus scraping kvtune's engines and evaluating its alert rules while the `with` lasts."""

    def __init__(
        self,
        targets: list[ScrapeTarget],
        rules_yaml: str,
        folder: Path,
        *,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        interval_s: float = 5.0,
        binary: str = "prometheus",
    ) -> None:
        self.targets = targets
        self.rules_yaml = rules_yaml
        self.folder = folder
        self.host = host
        self.port = port
        self.interval_s = interval_s
        self.binary = binary
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "prometheus.log"

    def write_config(self) -> Path:
        """Write the rules and prometheus.yml into the folder; the config's path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        rules = self.folder / "kvtune-alerts.yaml"
        rules.write_text(self.rules_yaml)
        config = self.folder / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(scrape_config(self.targets, rules, self.interval_s), sort_keys=False)
        )
        return config

    def start(self) -> None:
        executable = shutil.which(self.binary)
        if executable is None:
            raise PrometheusError(f"`{self.binary}` is not on PATH; {INSTALL_HINT}")
        config = self.write_config()
        argv = [
            executable,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.folder / 'data'}",
            # No --web.enable-lifecycle: it lets anyone who reaches the port stop Prometheus (POST /-/quit).
            f"--web.listen-address={self.host}:{self.port}",
        ]
        with self.log_path.open("ab") as log_file:
            self._proc = subprocess.Popen(
                argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_ready()
        except BaseException:  # Ctrl-C included: never leave a half-started Prometheus behind
            self.stop()
            raise
        log.info("Prometheus at %s scraping %d engine(s); log %s", self.url, len(self.targets), self.log_path)

    def _wait_ready(self) -> None:
        if self._proc is None:
            raise PrometheusError("Prometheus was not started")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise PrometheusError(
                    f"Prometheus exited with code {self._proc.returncode} before it was ready: "
                    + " | ".join(tail)
                )
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise PrometheusError(f"Prometheus did not become ready at {self.url} in {READY_TIMEOUT_S:.0f} s")

    def stop(self) -> None:
        if self._proc is not None:
            stop_group(self._proc, STOP_GRACE_S)
            self._proc = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()
