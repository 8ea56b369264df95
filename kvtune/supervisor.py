"""Keep engines serving: start each, warm its cache, restart it when it dies (with backoff and a limit)."""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from kvtune import metrics
from kvtune.engine import Engine, EngineError, failure_reason
from kvtune.profile import EngineProfile
from kvtune.warmup import warm_up

log = logging.getLogger(__name__)


class State(StrEnum):
    STARTING = "starting"
    WARMING = "warming"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    backoff_initial: float = 2.0
    backoff_max: float = 60.0

    def delay(self, attempt: int) -> float:
        return float(min(self.backoff_initial * 2.0 ** (attempt - 1), self.backoff_max))


@dataclass
class EngineStatus:
    """What the control API reports for one engine."""

    name: str
    url: str
    state: State = State.STARTING
    pid: int | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    last_failure: str | None = None
    warmup_done: bool | None = False  # None: the profile has no warm-up to send
    warmup_seconds: float | None = None
    kv_capacity: dict[str, Any] | None = None
    log_path: str = ""
    profile: dict[str, Any] = field(default_factory=dict)
    host_note: str | None = None  # how the profile was adapted to this host (e.g. fp8 KV fallback)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


HIDDEN = "<hidden>"


def shown_profile(profile: EngineProfile) -> dict[str, Any]:
    """The profile as the control API shows it: extra_args keep their long flags, never their values
    (nor short options, whose value may be attached: -O3).

    A value passed through extra_args may be anything, a credential included; the flags say enough to
    tell engines apart, and the profile file on the host has the rest.
    """
    shown = profile.model_dump(mode="json")
    shown["extra_args"] = [
        arg.split("=", 1)[0] + ("=" + HIDDEN if "=" in arg else "") if arg.startswith("--") else HIDDEN
        for arg in profile.extra_args
    ]
    return shown


class SupervisedEngine:
    """One engine and the thread that keeps it running until `stop()`."""

    def __init__(self, engine: Engine, policy: RestartPolicy, host_note: str | None = None) -> None:
        self.engine = engine
        self.policy = policy
        profile: EngineProfile = engine.profile
        self.status = EngineStatus(
            name=profile.name,
            url=profile.url,
            log_path=str(engine.log_path),
            profile=shown_profile(profile),
            host_note=host_note,
        )
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.ready_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-{profile.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _set(self, **changes: Any) -> None:
        with self._lock:
            for key, value in changes.items():
                setattr(self.status, key, value)

    def snapshot(self) -> EngineStatus:
        with self._lock:
            return EngineStatus(**asdict(self.status))

    def _run(self) -> None:
        name = self.engine.profile.name
        while not self._stopping.is_set():
            try:
                self._serve_once()
            except EngineError as exc:
                self._set(last_failure=str(exc))
                log.error("engine %s: %s", name, exc)
            except Exception as exc:  # noqa: BLE001 - not the engine's fault: a restart would fail the same way
                self._fail_for_good(f"{type(exc).__name__}: {exc}")
                return
            if self._stopping.is_set():
                break
            code = self.engine.stop()
            reason = failure_reason(self.engine.log_path)
            restarts = self.status.restarts + 1
            if restarts > self.policy.max_restarts:
                self._set(state=State.FAILED, pid=None, last_exit_code=code)
                log.error("engine %s: gave up after %d restarts", name, self.policy.max_restarts)
                self.ready_event.set()  # wake waiters: it will not become ready
                return
            delay = self.policy.delay(restarts)
            self._set(
                state=State.RESTARTING,
                pid=None,
                last_exit_code=code,
                restarts=restarts,
                warmup_done=False,
                last_failure=self.status.last_failure or reason,
            )
            log.warning(
                "engine %s: exited with code %s (%s); restart %d/%d in %.0f s",
                name,
                code,
                reason,
                restarts,
                self.policy.max_restarts,
                delay,
            )
            self._stopping.wait(delay)
        self.engine.stop()
        self._set(state=State.STOPPED, pid=None)

    def _fail_for_good(self, reason: str) -> None:
        """End this engine as failed with `reason` and wake everyone waiting for it."""
        log.error("engine %s failed: %s", self.engine.profile.name, reason)
        code = self.engine.stop()
        self._set(state=State.FAILED, pid=None, last_exit_code=code, last_failure=reason)
        self.ready_event.set()

    def _serve_once(self) -> None:
        """Start, wait until ready, warm up, then watch until the process ends or we are stopped."""
        engine, profile = self.engine, self.engine.profile
        self._set(state=State.STARTING, warmup_done=False)
        engine.start()
        self._set(pid=engine.pid)
        engine.wait_ready(cancel=self._stopping)
        try:
            capacity = metrics.KvCapacity.from_samples(metrics.scrape(engine.url))
        except httpx.HTTPError as exc:
            raise EngineError(f"reading {engine.url}/metrics failed: {exc}") from exc
        self._set(state=State.WARMING, kv_capacity=asdict(capacity) if capacity else None)
        try:
            seconds = warm_up(profile)
        except httpx.HTTPError as exc:
            raise EngineError(f"warm-up failed: {exc}") from exc
        self._set(
            state=State.READY,
            warmup_done=True if profile.warmup else None,
            warmup_seconds=round(seconds, 3),
            last_failure=None,
        )
        log.info("engine %s: ready at %s/v1 (warm-up %.1f s)", profile.name, engine.url, seconds)
        self.ready_event.set()
        while not self._stopping.wait(0.5):
            if not engine.is_running():
                self._set(last_failure=f"engine process exited with code {engine.returncode()}")
                return

    def stop(self) -> None:
        self._stopping.set()
        self.engine.stop()  # unblocks a start-up or warm-up in progress
        self._thread.join()


class Supervisor:
    """All engines of one `kvtune up`."""

    def __init__(
        self,
        engines: list[Engine],
        policy: RestartPolicy | None = None,
        host_notes: dict[str, str] | None = None,
    ) -> None:
        notes = host_notes or {}
        self.engines = [
            SupervisedEngine(engine, policy or RestartPolicy(), notes.get(engine.profile.name))
            for engine in engines
        ]

    def start(self) -> None:
        for supervised in self.engines:
            supervised.start()

    def statuses(self) -> list[EngineStatus]:
        return [supervised.snapshot() for supervised in self.engines]

    def wait_all_settled(self, stop: threading.Event) -> None:
        """Block until every engine is ready (or has failed for good), or `stop` is set."""
        for supervised in self.engines:
            while not supervised.ready_event.wait(0.5):
                if stop.is_set():
                    return

    def stop(self) -> None:
        # Stop engines in parallel: each may take its grace period.
        threads = [threading.Thread(target=s.stop) for s in self.engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
