"""Keeping the router's picture of each engine current: readiness, load, and the blocks it reports.

- `watch_engine` polls `/health` (an engine that is down, restarting or unready gets no traffic, and
  rejoins when it answers) and scrapes `/metrics` for queued requests and KV usage. Each read has a total
  deadline and a size cap; a read that fails, or a `/metrics` that is not a readable exposition (garbage,
  an HTML page, negative or non-finite load), leaves the engine unready until a healthy read, and is
  counted as an upstream error of kind watch_* (an engine that simply does not answer is not counted:
  it is down, and its health says so).
- `follow_kv_events` receives the engine's ZMQ KV events (the router binds, the engine connects; or
  through a fan-out when several router workers follow one engine) and keeps its ReportedBlocks, first
  rebuilt from the engine's replay buffer when it serves one (kv_replay.py).
  A sequence gap, an undecodable batch, a block whose parent was never seen or a malformed event that
  may have evicted blocks makes the view stale: it is cleared, the kv_events policy judges that engine by
  what the router sent it, and the view counts as fresh again only once the engine's cache is known to be
  empty to the view too (an AllBlocksCleared event, or a new engine process, whose batches are numbered
  from 0 again). Each resync is counted, and each event skipped.
Both run supervised (supervise.py): whatever else goes wrong restarts them.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvtune import metrics
from kvtune.router.kv_events import (
    AllBlocksCleared,
    KvEventError,
    RejectedEvent,
    SequenceTracker,
    apply_batch,
    decode_batch,
    decode_sequence,
)
from kvtune.router.kv_replay import ReplayedBatches, ReplayUnavailable, fetch_replay
from kvtune.router.policies import EngineState
from kvtune.router.router_metrics import RouterMetrics
from kvtune.router.upstream import AnswerTooLarge, Upstream

log = logging.getLogger(__name__)
# A view holding more blocks than this many times the engine's pool has missed removals (vLLM cannot hold
# more than its pool; the slack covers a pool the router has not read yet).
REPORTED_SLACK = 4
# The largest KV-event message read: vLLM's batches are kilobytes; a bigger one is refused by ZMQ itself
# (the publisher is disconnected and reconnects: a gap, so a resync) before the router allocates it.
MAX_KV_MESSAGE_BYTES = 64 << 20
# A pool size beyond any engine's (vllm:cache_config_info num_gpu_blocks); larger is not believed.
MAX_POOL_BLOCKS = 10**9


@dataclass(frozen=True)
class WatchLimits:
    period_s: float = 1.0
    # Per call, connect to last byte: an engine answering more slowly is treated as not answering.
    deadline_s: float = 5.0
    health_bytes: int = 64 << 10
    # vLLM 0.32.0's /metrics is ~100 KB for one model; parsing it costs ~0.4 s of CPU per MB.
    metrics_bytes: int = 4 << 20


DEFAULT_WATCH = WatchLimits()


class UnhealthyRead(Exception):
    """A read that leaves the engine unready; KIND labels the upstream-error metric (None: not counted);
    HEALTH when /health itself failed (the engine may have restarted since, and lost its cache)."""

    def __init__(self, kind: str | None, detail: str, health: bool = False) -> None:
        super().__init__(detail)
        self.kind = kind
        self.health = health


@dataclass(frozen=True)
class EngineLoad:
    waiting: float
    kv_usage: float
    pool_blocks: int | None


def read_load(text: str) -> EngineLoad:
    """The load an engine's /metrics text reports; UnhealthyRead when it is not one vLLM would write."""
    # Every sample as written, none left out: a load no engine would report makes the read unhealthy.
    try:
        scraped = [
            metrics.Sample(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        # The parser quotes the line it choked on: an engine's text, kept short in the log.
        problem = str(exc)[:120]
        raise UnhealthyRead(
            "watch_malformed", f"/metrics is not a Prometheus exposition ({problem})"
        ) from None
    waiting = metrics.total(scraped, metrics.REQUESTS_WAITING)
    kv_usage = metrics.total(scraped, metrics.KV_CACHE_USAGE)
    for name, value in ((metrics.REQUESTS_WAITING, waiting), (metrics.KV_CACHE_USAGE, kv_usage)):
        if not (math.isfinite(value) and value >= 0):
            raise UnhealthyRead("watch_malformed", f"/metrics reports {name} {value}")
    blocks = metrics.cache_config(scraped).get("num_gpu_blocks", "")
    pool = int(blocks) if blocks.isascii() and blocks.isdigit() and len(blocks) < 12 else None
    return EngineLoad(waiting, kv_usage, pool if pool and pool <= MAX_POOL_BLOCKS else None)


async def _get(upstream: Upstream, url: str, path: str, limit_bytes: int, deadline_s: float) -> bytes:
    health = path == "/health"
    try:
        status, body = await upstream.get_whole(url + path, limit_bytes, deadline_s)
    except TimeoutError:
        raise UnhealthyRead("watch_timeout", f"{path} took more than {deadline_s:g} s", health) from None
    except AnswerTooLarge as exc:
        raise UnhealthyRead("watch_too_large", f"{path}: {exc}", health) from None
    except (aiohttp.ClientError, OSError) as exc:
        raise UnhealthyRead(None, f"{path} does not answer ({type(exc).__name__})", health) from None
    if status != 200:  # /health is not 200 while an engine starts or after its core died
        raise UnhealthyRead(None if health else "watch_malformed", f"{path} answers {status}", health)
    return body


async def read_engine(url: str, upstream: Upstream, limits: WatchLimits) -> EngineLoad:
    """The engine's load when /health and /metrics both read healthy; UnhealthyRead otherwise."""
    await _get(upstream, url, "/health", limits.health_bytes, limits.deadline_s)
    body = await _get(upstream, url, "/metrics", limits.metrics_bytes, limits.deadline_s)
    try:
        text = body.decode()
    except UnicodeDecodeError:
        raise UnhealthyRead("watch_malformed", "/metrics is not UTF-8 text") from None
    # Parsing is pure Python (tens of ms for vLLM's): off the event loop, so requests keep flowing.
    return await asyncio.to_thread(read_load, text)


async def watch_engine(
    engine: EngineState,
    upstream: Upstream,
    router_metrics: RouterMetrics,
    limits: WatchLimits = DEFAULT_WATCH,
    on_restart: Callable[[EngineState], None] | None = None,
) -> None:
    """Forever: readiness from /health, load from /metrics; ON_RESTART when an engine comes back after
    its /health failed (a /metrics read that failed alone does not mean the engine lost its cache)."""
    health_failed = True  # what an engine held before the router watched it is unknown
    while True:
        was_ready = engine.ready
        try:
            load = await read_engine(engine.url, upstream, limits)
        except UnhealthyRead as bad:
            engine.ready = False
            health_failed = health_failed or bad.health
            if bad.kind is not None:
                router_metrics.upstream_errors.labels(engine.name, bad.kind).inc()
            if was_ready:
                log.warning("engine %s: %s; it gets no traffic until it reads healthy", engine.name, bad)
        else:
            engine.waiting, engine.kv_usage = load.waiting, load.kv_usage
            if load.pool_blocks is not None:  # the pool vLLM really allocated bounds what it can hold
                engine.sent.capacity = load.pool_blocks
            engine.ready = True
            if not was_ready:
                log.info("engine %s is ready", engine.name)
                if health_failed and on_restart is not None:
                    on_restart(engine)
            health_failed = False
        await asyncio.sleep(limits.period_s)


def forget_sent(engine: EngineState) -> None:
    """A (re)started engine holds nothing the router sent before (its KV events say so themselves)."""
    engine.sent.clear()


OnResync = Callable[[EngineState, str], None]
OnReject = Callable[[EngineState, RejectedEvent], None]
# Before the replay is asked for, the live stream must be flowing, or a batch sent meanwhile is lost (a
# gap): the follower waits for its first connection's handshake (at most CONNECT_WAIT_S: an engine still
# starting has none), then SUBSCRIBE_SETTLE_S for the subscription it sends then to reach the publisher.
CONNECT_WAIT_S = 5.0
SUBSCRIBE_SETTLE_S = 0.2


@dataclass(frozen=True)
class KvEventSource:
    """Where a router reads one engine's KV events.

    ENDPOINT: the live stream. The router binds it and the engine's publisher connects (vLLM binds only
    wildcard endpoints, tcp://*:PORT, all interfaces, and connects to an explicit address, so a loopback
    endpoint keeps the events off the network; server.py decides it), or, with CONNECT, the router
    connects to a fan-out that bound it (router workers: fanout.py). REPLAY: the engine's replay endpoint,
    read each time the follower starts, so a router that starts after the engine does not start empty."""

    endpoint: str
    connect: bool = False
    replay: str | None = None


async def follow_kv_events(
    engine: EngineState,
    source: KvEventSource,
    on_resync: OnResync,
    context: zmq.asyncio.Context | None = None,
    on_reject: OnReject | None = None,
    on_started: Callable[[EngineState], None] | None = None,
) -> None:
    """Forever: apply ENGINE's KV-event batches from SOURCE (after its replay, when it has one; ON_STARTED
    hears when the view is as complete as the replay makes it)."""
    context = context or zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_KV_MESSAGE_BYTES)
    hear: Callable[[RejectedEvent], None] | None = None
    if on_reject is not None:
        hook = on_reject

        def hear(rejected: RejectedEvent) -> None:
            hook(engine, rejected)

    def apply(frames: list[bytes]) -> None:
        problem = apply_message(engine, frames, tracker, hear)
        if problem is not None and engine.reported_fresh:
            engine.reported.cleared()
            engine.reported_fresh = False
            on_resync(engine, problem)

    try:
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) if source.replay else None
        if source.connect:
            socket.connect(source.endpoint)
        else:
            socket.bind(source.endpoint)
        tracker = SequenceTracker()
        replayed = ReplayedBatches()
        if monitor is not None and source.replay is not None and await _first_handshake(socket, monitor):
            await _rebuild_from_replay(engine, source.replay, context, apply, replayed)
        if source.replay is None:
            log.info(
                "engine %s: no KV-event replay (kv_events_replay_port): the view starts empty", engine.name
            )
        if on_started is not None:
            on_started(engine)
        while True:
            frames = await socket.recv_multipart()
            if not replayed.already_applied(frames):
                apply(frames)
    finally:
        socket.close()


async def _rebuild_from_replay(
    engine: EngineState,
    replay: str,
    context: zmq.asyncio.Context,
    apply: Callable[[list[bytes]], None],
    replayed: ReplayedBatches,
) -> None:
    """Apply every batch REPLAY still holds (noting them in REPLAYED); the view stays as the live stream
    leaves it when the replay does not answer."""
    try:
        batches = await fetch_replay(replay, MAX_KV_MESSAGE_BYTES, context)
    except ReplayUnavailable as exc:  # not started yet, or gone: the live stream tells the rest
        log.info("engine %s: no KV-event replay (%s); following the live stream", engine.name, exc)
        return
    for frames in batches:
        apply(frames)
        replayed.add(frames)
    if not batches:  # nothing published yet: the empty view is exact
        engine.reported.cleared()
        engine.reported_fresh = True
    log.info(
        "engine %s: KV-event view rebuilt from %d replayed batches (%s blocks, %s)",
        engine.name, len(batches), f"{engine.reported.engine_blocks:,}",
        "fresh" if engine.reported_fresh else "stale: the replay did not reach batch 0",
    )  # fmt: skip


async def _first_handshake(socket: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> bool:
    """Wait for SOCKET's first connection (at most CONNECT_WAIT_S) and for its subscription to travel;
    False when nothing connected (an engine still starting: it has nothing to replay, and its batches
    will be numbered from 0)."""
    try:
        async with asyncio.timeout(CONNECT_WAIT_S):
            await monitor.recv_multipart()
        await asyncio.sleep(SUBSCRIBE_SETTLE_S)
        return True
    except TimeoutError:
        return False
    finally:
        socket.disable_monitor()
        monitor.close()


def apply_message(
    engine: EngineState,
    frames: list[bytes],
    tracker: SequenceTracker,
    on_reject: Callable[[RejectedEvent], None] | None = None,
) -> str | None:
    """Apply one message; the reason the view went stale, or None. ON_REJECT hears of each event skipped."""
    try:
        _topic, sequence_frame, payload = frames
        sequence = decode_sequence(sequence_frame)
        batch = decode_batch(payload)
    except (ValueError, KvEventError) as exc:
        return f"unreadable message ({exc})"
    if on_reject is not None:
        for event in batch.events:
            if isinstance(event, RejectedEvent):
                on_reject(event)
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
    problem = apply_batch(engine.reported, batch)
    if problem is None and engine.reported.engine_blocks > REPORTED_SLACK * engine.sent.capacity:
        problem = (
            f"view larger than the engine's KV pool ({engine.reported.engine_blocks:,} blocks reported held, "
            f"the pool has {engine.sent.capacity:,}: removals were lost)"
        )
    return problem
