"""Keeping the router's picture of each engine current: readiness, load, and the blocks it reports.

- `watch_engine` polls `/health` (an engine that is down, restarting or unready gets no traffic, and
  rejoins when it answers) and scrapes `/metrics` for queued requests and KV usage.
- `follow_kv_events` receives the engine's ZMQ KV events (the router binds, the engine connects) and
  keeps its ReportedBlocks.
  A sequence gap, an undecodable batch or a block whose parent was never seen makes the view stale:
  it is cleared, the kv_events policy judges that engine by what the router sent it, and the view counts
  as fresh again only once the engine's cache is known to be empty to the view too (an AllBlocksCleared
  event, or a new engine process, whose batches are numbered from 0 again). Each resync is counted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx
import zmq
import zmq.asyncio

from kvtune import metrics
from kvtune.router.kv_events import (
    AllBlocksCleared,
    KvEventError,
    SequenceTracker,
    apply_batch,
    decode_batch,
    decode_sequence,
)
from kvtune.router.policies import EngineState

log = logging.getLogger(__name__)


async def watch_engine(
    engine: EngineState,
    client: httpx.AsyncClient,
    period_s: float = 1.0,
    on_restart: Callable[[EngineState], None] | None = None,
) -> None:
    """Forever: readiness from /health, load from /metrics; ON_RESTART when an engine comes back."""
    while True:
        was_ready = engine.ready
        try:
            health = await client.get(engine.url + "/health", timeout=min(2.0, period_s * 2))
            engine.ready = health.status_code == 200
            if engine.ready:
                scraped = metrics.parse((await client.get(engine.url + "/metrics", timeout=2.0)).text)
                engine.waiting = metrics.total(scraped, metrics.REQUESTS_WAITING)
                engine.kv_usage = metrics.total(scraped, metrics.KV_CACHE_USAGE)
                blocks = metrics.cache_config(scraped).get("num_gpu_blocks")
                if blocks and blocks.isdigit():  # the pool vLLM really allocated bounds what it can hold
                    engine.sent.capacity = int(blocks)
        except httpx.HTTPError:
            engine.ready = False
        if engine.ready and not was_ready:
            log.info("engine %s is ready", engine.name)
            if on_restart is not None:
                on_restart(engine)
        elif was_ready and not engine.ready:
            log.warning("engine %s stopped answering; it gets no traffic until it does", engine.name)
        await asyncio.sleep(period_s)


def forget_sent(engine: EngineState) -> None:
    """A (re)started engine holds nothing the router sent before (its KV events say so themselves)."""
    engine.sent.clear()


async def follow_kv_events(
    engine: EngineState,
    endpoint: str,
    on_resync: Callable[[EngineState, str], None],
    context: zmq.asyncio.Context | None = None,
) -> None:
    """Forever: apply ENGINE's KV-event batches arriving at ENDPOINT (e.g. tcp://127.0.0.1:5557).

    The router binds it and the engine's publisher connects: vLLM binds only wildcard endpoints
    (tcp://*:PORT, all interfaces) and connects to an explicit address, so a loopback endpoint keeps the
    events off the network."""
    context = context or zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(endpoint)
    tracker = SequenceTracker()
    try:
        while True:
            frames = await socket.recv_multipart()
            problem = apply_message(engine, frames, tracker)
            if problem is not None and engine.reported_fresh:
                engine.reported.cleared()
                engine.reported_fresh = False
                on_resync(engine, problem)
    finally:
        socket.close()


def apply_message(engine: EngineState, frames: list[bytes], tracker: SequenceTracker) -> str | None:
    """Apply one message; the reason the view went stale, or None."""
    try:
        _topic, sequence_frame, payload = frames
        sequence = decode_sequence(sequence_frame)
        batch = decode_batch(payload)
    except (ValueError, KvEventError) as exc:
        return f"unreadable message: {exc}"
    # vLLM numbers batches from 0 in each engine process: a sequence that starts again is a new engine,
    # whose cache is empty.
    restarted = sequence == 0 or (tracker.last is not None and sequence <= tracker.last)
    contiguous = tracker.next_is_contiguous(sequence)
    if restarted:
        engine.reported.cleared()
        engine.reported_fresh = True
    elif not engine.reported_fresh:
        # Stale: only an empty cache makes the view exact again; apply from the last clear on.
        clears = [i for i, event in enumerate(batch.events) if isinstance(event, AllBlocksCleared)]
        if not clears:
            return None
        batch.events = batch.events[clears[-1] :]
        engine.reported_fresh = True
    elif not contiguous:
        return "sequence gap (batches lost)"
    if not apply_batch(engine.reported, batch):
        return "a block stored after a parent the view never saw"
    return None
