"""vLLM's KV-cache events as the router reads them off ZMQ, and what they do to an engine's reported view.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`) publishes each
batch as three frames: topic, an 8-byte big-endian sequence number, and a msgpack `KVEventBatch`
(`[ts, events, data_parallel_rank]`, each event a map tagged by its class name). The structs below read
that wire format without importing vLLM (decoding is on the router's hot path; unknown fields that newer
vLLM versions add are ignored). A sequence gap means batches were dropped, so the view is stale: the
caller rebuilds it (and routes by what it sent meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvtune.router.prefix_index import ReportedBlocks

BlockHash = int | bytes


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EventBatch)


class KvEventError(ValueError):
    """A message that is not a vLLM KV-event batch."""


def decode_batch(payload: bytes) -> EventBatch:
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise KvEventError(f"not a vLLM KV-event batch: {exc}") from None


def decode_sequence(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvEventError(f"a KV-event sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def apply_batch(view: ReportedBlocks, batch: EventBatch) -> bool:
    """Apply BATCH's events to VIEW in order; False when one cannot be applied (a block stored after a
    parent the view never saw): events were lost before this batch and the view needs a rebuild."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            if not view.stored(
                event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
            ):
                return False
        elif isinstance(event, BlockRemoved):
            view.removed(event.block_hashes)
        else:
            view.cleared()
    return True


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
