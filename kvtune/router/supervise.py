"""Background tasks that outlive their own failures: an engine's health watcher and KV-event follower.

A task that raises (a bug, or an engine's input nobody foresaw) would otherwise die silently and leave its
engine as it last saw it: "ready" after it died, or routed by a KV view nobody updates. Supervised, the
failure is logged in one line with its engine, counted, the engine gets no traffic until its watcher
reads it healthy again, and the task starts over after a backoff that doubles while it keeps failing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from kvtune.router.policies import EngineState
from kvtune.router.router_metrics import RouterMetrics

log = logging.getLogger(__name__)

Task = Literal["watch", "kv_events"]


@dataclass(frozen=True)
class Backoff:
    first_s: float = 0.5
    max_s: float = 30.0
    # A run that lasted this long was healthy: the next failure waits first_s again.
    healthy_s: float = 60.0


DEFAULT_BACKOFF = Backoff()
# A failure's message can carry what an engine sent: the log line keeps its start.
PROBLEM_CHARS = 300


async def supervise(
    task: Task,
    engine: EngineState,
    run: Callable[[], Awaitable[None]],
    metrics: RouterMetrics,
    backoff: Backoff = DEFAULT_BACKOFF,
    on_failure: Callable[[EngineState], None] | None = None,
) -> None:
    """Run RUN (which runs forever) until cancelled, starting it again each time it fails."""
    delay = backoff.first_s
    while True:
        started = time.monotonic()
        try:
            await run()
            problem = "it returned"
        except Exception as exc:  # whatever a task raises (cancelling it is not an Exception), carry on
            problem = " ".join(f"{type(exc).__name__}: {exc}".split())[:PROBLEM_CHARS]
            log.debug("engine %s: %s task failed", engine.name, task, exc_info=True)
        if time.monotonic() - started >= backoff.healthy_s:
            delay = backoff.first_s
        metrics.background_failures.labels(engine.name, task).inc()
        engine.ready = False  # until its watcher reads it healthy again
        if on_failure is not None:
            on_failure(engine)
        log.error(
            "engine %s: the %s task failed (%s); it gets no traffic until read healthy; restarting the task "
            "in %.1f s",
            engine.name, task, problem, delay,
        )  # fmt: skip
        await asyncio.sleep(delay)
        delay = min(delay * 2, backoff.max_s)
