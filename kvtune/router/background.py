"""The router's work beside the requests, per engine: a health watcher for each, a KV-event follower for
each that publishes events, all supervised (supervise.py), all counted in the router's metrics."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any

from kvtune import metrics
from kvtune.router.engine_watch import (
    KvEventSource,
    WatchLimits,
    follow_kv_events,
    forget_sent,
    watch_engine,
)
from kvtune.router.kv_events import RejectedEvent
from kvtune.router.policies import EngineState
from kvtune.router.router_metrics import RouterMetrics
from kvtune.router.supervise import DEFAULT_BACKOFF, Backoff, supervise
from kvtune.router.upstream import Upstream

log = logging.getLogger(__name__)


class Background:
    def __init__(
        self,
        engines: Sequence[EngineState],
        kv_events: Mapping[str, KvEventSource | None],
        upstream: Upstream,
        router_metrics: RouterMetrics,
        watch: WatchLimits,
        backoff: Backoff = DEFAULT_BACKOFF,
    ) -> None:
        self.engines = engines
        self.kv_events = kv_events
        self.upstream = upstream
        self.metrics = router_metrics
        self.watch = watch
        self.backoff = backoff
        self._told: set[tuple[str, str]] = set()
        self._followers_started: set[str] = set()

    def tasks(self) -> list[Coroutine[Any, Any, None]]:
        """One coroutine per task, each running until cancelled."""
        tasks = [self._watched(engine) for engine in self.engines]
        for engine in self.engines:
            if (source := self.kv_events.get(engine.name)) is not None:
                tasks.append(self._followed(engine, source))
        return tasks

    async def _watched(self, engine: EngineState) -> None:
        run = functools.partial(watch_engine, engine, self.upstream, self.metrics, self.watch, forget_sent)
        await supervise("watch", engine, run, self.metrics, self.backoff)

    async def _followed(self, engine: EngineState, source: KvEventSource) -> None:
        run = functools.partial(
            follow_kv_events, engine, source, self.on_resync, on_reject=self.on_reject,
            on_started=lambda started: self._followers_started.add(started.name),
        )  # fmt: skip
        await supervise("kv_events", engine, run, self.metrics, self.backoff, on_failure=self.view_stale)

    async def settled(self, deadline_s: float) -> None:
        """Wait (at most DEADLINE_S) until every engine reads ready and every KV-event view is rebuilt from
        its replay: a router worker started again then routes its first request as the others would."""
        followed = {name for name, source in self.kv_events.items() if source is not None}
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if all(engine.ready for engine in self.engines) and followed <= self._followers_started:
                return
            await asyncio.sleep(0.05)

    def on_resync(self, engine: EngineState, cause: str) -> None:
        log.warning("engine %s: KV-event view stale (%s); routing it by what was sent", engine.name, cause)
        self.metrics.kv_events_resyncs.labels(engine.name, cause.split(" (")[0]).inc()

    def on_reject(self, engine: EngineState, rejected: RejectedEvent) -> None:
        self.metrics.kv_events_rejected.labels(engine.name, rejected.reason).inc()
        if (engine.name, rejected.reason) not in self._told:  # once per reason: a faulty publisher repeats
            self._told.add((engine.name, rejected.reason))
            log.warning(
                "engine %s: a KV event skipped (%s: %s); more are counted in %s",
                engine.name, rejected.reason, rejected.detail[:200], metrics.ROUTER_KV_EVENTS_REJECTED,
            )  # fmt: skip

    def view_stale(self, engine: EngineState) -> None:
        """The follower failed: events may have been missed while it restarts."""
        if engine.reported_fresh:
            engine.reported.cleared()
            engine.reported_fresh = False
            self.on_resync(engine, "follower failed (events may have been missed)")
