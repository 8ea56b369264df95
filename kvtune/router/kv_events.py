"""vLLM's KV-cache events as the router reads them off ZMQ, and what they do to an engine's reported view.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`) publishes each
batch as three frames: topic, an 8-byte big-endian sequence number, and a msgpack `KVEventBatch`
(`[ts, events, data_parallel_rank]`, each event a map tagged by its class name). The structs below read
that wire format without importing vLLM (decoding is on the router's hot path; unknown fields that newer
vLLM versions add are ignored). A sequence gap means batches were dropped, so the view is stale: the
caller rebuilds it (and routes by what it sent meanwhile).

Each event is read and checked on its own, so one malformed event costs only itself: it is skipped and
reported (`RejectedEvent`, by reason). The view must never claim a block the engine does not hold, so
skipping a malformed `BlockStored` is safe (the view holds less; a later block built on it shows up as an
unknown parent and rebuilds the view), while a malformed removal, or an event whose kind cannot be read,
may hide an eviction and makes the view stale. An event of a kind this reader does not know (a newer
vLLM's) is skipped without that.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvtune.router.prefix_index import MAX_TOKEN_ID, ReportedBlocks

BlockHash = int | bytes
# Bounds no vLLM event comes near (vLLM 0.32.0 hashes are 32-byte digests or 64-bit ints; a block holds
# at most a few hundred tokens; one event lists the blocks of one request's step), so a value beyond
# them is a faulty or hostile publisher's, and the router's work per event stays small.
MAX_HASH_BYTES = 64
MAX_BLOCK_SIZE = 1 << 16
MAX_EVENT_BLOCKS = 1 << 16
MAX_EVENT_TOKENS = 1 << 22


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared
KNOWN_KINDS = frozenset(kind.__name__ for kind in (BlockStored, BlockRemoved, AllBlocksCleared))


@dataclass(frozen=True)
class RejectedEvent:
    """An event skipped: REASON labels the metric (unknown_kind, wrong_fields, block_size, too_large,
    token_ids, hash); KIND is its tag when that is a known one."""

    reason: str
    detail: str
    kind: str | None = None

    @property
    def hides_evictions(self) -> bool:
        """Skipping it may leave the view holding blocks the engine evicted: the view must be rebuilt."""
        return self.reason != "unknown_kind" and self.kind != BlockStored.__name__


@dataclass
class EventBatch:
    ts: float
    events: list[Event | RejectedEvent]


class _WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _Tagged(msgspec.Struct):
    type: str


_batch_decoder = msgspec.msgpack.Decoder(_WireBatch)
_event_decoder = msgspec.msgpack.Decoder(Event)
_tag_decoder = msgspec.msgpack.Decoder(_Tagged)


class KvEventError(ValueError):
    """A message that is not a vLLM KV-event batch."""


def decode_batch(payload: bytes) -> EventBatch:
    try:
        wire = _batch_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KvEventError(f"not a vLLM KV-event batch: {exc}") from None
    return EventBatch(wire.ts, [decode_event(raw) for raw in wire.events])


def decode_event(raw: msgspec.Raw) -> Event | RejectedEvent:
    """One event, or why it is skipped."""
    try:
        event = _event_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        kind = _kind_of(raw)
        if kind is not None and kind not in KNOWN_KINDS:
            return RejectedEvent("unknown_kind", f"an event of kind {kind[:40]!r}")
        return RejectedEvent("wrong_fields", str(exc), kind)
    problem = _problem(event)
    if problem is not None:
        return RejectedEvent(*problem, type(event).__name__)
    return event


def _kind_of(raw: msgspec.Raw) -> str | None:
    try:
        return _tag_decoder.decode(raw).type
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _hash_problem(hashes: list[BlockHash], parent: BlockHash | None) -> str | None:
    if len(hashes) > MAX_EVENT_BLOCKS:
        return f"{len(hashes):,} blocks in one event (at most {MAX_EVENT_BLOCKS:,})"
    for value in (*hashes, parent):
        if isinstance(value, bytes) and len(value) > MAX_HASH_BYTES:
            return f"a block hash of {len(value):,} bytes (at most {MAX_HASH_BYTES})"
    return None


def _problem(event: Event) -> tuple[str, str] | None:
    """(reason, detail) when EVENT's fields hold values no engine sends."""
    if isinstance(event, AllBlocksCleared):
        return None
    parent = event.parent_block_hash if isinstance(event, BlockStored) else None
    if (problem := _hash_problem(event.block_hashes, parent)) is not None:
        reason = "too_large" if len(event.block_hashes) > MAX_EVENT_BLOCKS else "hash"
        return reason, problem
    if isinstance(event, BlockRemoved):
        return None
    size, tokens = event.block_size, event.token_ids
    if not 0 < size <= MAX_BLOCK_SIZE:
        return "block_size", f"block_size {size} (must be 1 to {MAX_BLOCK_SIZE:,})"
    if len(tokens) > MAX_EVENT_TOKENS:
        return "too_large", f"{len(tokens):,} token ids in one event (at most {MAX_EVENT_TOKENS:,})"
    if len(tokens) != len(event.block_hashes) * size:
        return "token_ids", f"{len(tokens)} token ids for {len(event.block_hashes)} blocks of {size}"
    if tokens and not (min(tokens) >= 0 and max(tokens) <= MAX_TOKEN_ID):
        return "token_ids", f"a token id outside 0 to {MAX_TOKEN_ID:,}"
    return None


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"a KV-event sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def apply_batch(view: ReportedBlocks, batch: EventBatch) -> str | None:
    """Apply BATCH's events to VIEW in order; why the view must be rebuilt (events were lost before this
    batch, or one that may have evicted blocks could not be read), or None."""
    for event in batch.events:
        if isinstance(event, RejectedEvent):
            if event.hides_evictions:
                return f"malformed event ({event.reason}; it may have evicted blocks)"
        elif isinstance(event, BlockStored):
            if not view.stored(
                event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
            ):
                return "a block stored after a parent the view never saw"
        elif isinstance(event, BlockRemoved):
            view.removed(event.block_hashes)
        else:
            view.cleared()
    return None


@dataclass
class SequenceTracker:
    """Whether batches arrive without a gap: vLLM numbers them 0, 1, 2, ... per publisher."""

    last: int | None = None
    gaps: int = 0

    def next_is_contiguous(self, sequence: int) -> bool:
        """Record SEQUENCE; False when batches were skipped (or the publisher restarted) since the last."""
        contiguous = self.last is None or sequence == self.last + 1
        if not contiguous:
            self.gaps += 1
        self.last = sequence
        return contiguous
