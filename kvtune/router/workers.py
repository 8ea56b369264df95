"""`kvtune up --router-workers N`: N router processes on one port, kept running.

Each worker (worker.py) gets the engines' KV events through the fan-out (fanout.py), which `kvtune up`
binds where the engines publish. A worker that exits (a crash, a SIGKILL) is started again after a
backoff that doubles while it keeps failing, as engines are; meanwhile the kernel sends new connections to
the workers still listening, and the connections the dead worker held are reset (their clients see an
error at once, not a hang). The restarted worker rebuilds each engine's view from the engine's replay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvtune.control_api import RouterWorkerStatus
from kvtune.processes import stop_groups
from kvtune.router.capture import CaptureSettings
from kvtune.router.fanout import KvEventFanout
from kvtune.router.proxy_settings import ProxySettings
from kvtune.router.server import RouterOptions, RouterTarget
from kvtune.router.supervise import Backoff
from kvtune.router.worker import WorkerSetup

log = logging.getLogger(__name__)
# Loading the tokenizer dominates a worker's start (seconds); far beyond it, the worker is not coming up.
WORKER_START_TIMEOUT_S = 120.0
STOP_GRACE_S = 10.0
MONITOR_PERIOD_S = 0.2
RESTART_BACKOFF = Backoff(first_s=0.5, max_s=30.0, healthy_s=60.0)
LOG_TAIL_BYTES = 2000
# The most `--router-workers` takes: each worker is a process with its own tokenizer and KV-event views, so
# past the host's cores more of them add memory, not throughput; 64 is also the most replicas a profile takes.
MAX_WORKERS = 64


@dataclass
class WorkerSlot:
    index: int
    port: int  # its own port: /metrics and /health of this worker alone
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    restart_at: float | None = None  # when a dead worker is due to start again
    delay_s: float = RESTART_BACKOFF.first_s

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class WorkerFailed(RuntimeError):
    """A worker did not come up at start (its log's tail in the message)."""


class RouterWorkers:
    """The router as OPTIONS.workers processes sharing OPTIONS.port, from `start` to `stop`."""

    def __init__(
        self,
        options: RouterOptions,
        targets: Sequence[RouterTarget],
        settings: ProxySettings,
        tokenizer_path: str,
        log_dir: Path,
        backoff: Backoff = RESTART_BACKOFF,
        capture: CaptureSettings | None = None,  # every worker writes its own files of this one capture
    ) -> None:
        self.options = options
        self.capture = capture
        self.targets = list(targets)
        self.settings = settings
        self.tokenizer_path = tokenizer_path
        self.backoff = backoff
        self.url = f"http://{options.host}:{options.port}"
        self.fanout = KvEventFanout({t.name: t.kv_events_url for t in targets if t.kv_events_url is not None})
        self.slots = [
            WorkerSlot(index, port, log_dir / f"router-worker-{index}.log")
            for index, port in enumerate(options.worker_ports)
        ]
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor = threading.Thread(target=self._watch, name="router-workers", daemon=True)

    def start(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> None:
        """The fan-out, then every worker, each answering on its own port; WorkerFailed (or OSError for
        the fan-out's ports) with everything started stopped again."""
        try:
            self.fanout.start()
            for slot in self.slots:
                self._spawn(slot)
            deadline = time.monotonic() + timeout_s
            for slot in self.slots:
                self._wait_answering(slot, deadline)
        except BaseException:
            self.stop()
            raise
        self._monitor.start()

    def _setup(self, slot: WorkerSlot) -> WorkerSetup:
        subscribed = self.fanout.subscribe_endpoints
        targets = [
            dataclasses.replace(t, kv_events_url=subscribed[t.name], kv_events_connect=True)
            if t.name in subscribed
            else t
            for t in self.targets
        ]
        return WorkerSetup(
            slot.index, slot.port, self.options, targets, self.settings, self.tokenizer_path, self.capture
        )

    def _spawn(self, slot: WorkerSlot) -> None:
        slot.log_path.parent.mkdir(parents=True, exist_ok=True)
        with slot.log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvtune.router.worker"],
                stdin=subprocess.PIPE, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        assert proc.stdin is not None  # noqa: S101 (stdin=PIPE)
        with contextlib.suppress(BrokenPipeError):  # it died at once: the monitor or the wait sees it
            proc.stdin.write(self._setup(slot).encode())
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
        slot.proc, slot.started_at, slot.restart_at = proc, time.monotonic(), None

    def _wait_answering(self, slot: WorkerSlot, deadline: float) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{slot.url}/health", timeout=2.0)
                return  # any answer (503 while no engine is ready yet) means it serves
            assert slot.proc is not None  # noqa: S101 (spawned)
            if slot.proc.poll() is not None or time.monotonic() > deadline:
                raise WorkerFailed(
                    f"router worker {slot.index} did not come up (exit code {slot.proc.poll()}); its log "
                    f"{slot.log_path} ends: {_tail(slot.log_path)}"
                )
            time.sleep(0.1)

    def _watch(self) -> None:
        """Restart workers that exit, each after its backoff, until stop."""
        while not self._stopping.wait(MONITOR_PERIOD_S):
            with self._lock:
                for slot in self.slots:
                    self._check(slot)

    def _check(self, slot: WorkerSlot) -> None:
        now = time.monotonic()
        if slot.restart_at is not None:
            if now >= slot.restart_at:
                slot.restarts += 1
                log.warning("router worker %d: starting again (restart %d)", slot.index, slot.restarts)
                self._spawn(slot)
            return
        assert slot.proc is not None  # noqa: S101 (spawned at start)
        code = slot.proc.poll()
        if code is None:
            return
        if now - slot.started_at >= self.backoff.healthy_s:
            slot.delay_s = self.backoff.first_s
        slot.restart_at = now + slot.delay_s
        log.error(
            "router worker %d (pid %d) exited with %d; the other workers keep serving; starting it again in "
            "%.1f s (log %s)",
            slot.index, slot.proc.pid, code, slot.delay_s, slot.log_path,
        )  # fmt: skip
        slot.delay_s = min(slot.delay_s * 2, self.backoff.max_s)

    def wait_seen_ready(self, names: Sequence[str]) -> list[str]:
        """Wait until every worker's health checks see NAMES ready; the names some worker still does not
        see after three health periods."""
        deadline = time.monotonic() + 3 * self.options.health_period_s + 1
        while True:
            unseen: set[str] = set()
            for slot in self.slots:
                ready: list[str] = []
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    ready = httpx.get(f"{slot.url}/health", timeout=2.0).json()["ready"]
                unseen |= {name for name in names if name not in ready}
            if not unseen or time.monotonic() > deadline:
                return sorted(unseen)
            time.sleep(0.1)

    def statuses(self) -> list[RouterWorkerStatus]:
        with self._lock:
            return [
                RouterWorkerStatus(
                    index=slot.index,
                    pid=slot.proc.pid if slot.proc is not None and slot.restart_at is None else None,
                    url=slot.url,
                    restarts=slot.restarts,
                    alive=slot.proc is not None and slot.proc.poll() is None,
                    log_path=str(slot.log_path),
                )
                for slot in self.slots
            ]

    def stop(self) -> None:
        self._stopping.set()
        if self._monitor.is_alive():
            self._monitor.join(timeout=5)
        with self._lock:
            stop_groups([slot.proc for slot in self.slots if slot.proc is not None], STOP_GRACE_S)
        self.fanout.stop()


def _tail(path: Path) -> str:
    try:
        data = path.read_bytes()[-LOG_TAIL_BYTES:]
    except OSError:
        return "(no log)"
    return " ".join(data.decode(errors="replace").split()[-60:])
