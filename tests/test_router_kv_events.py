"""The router reads vLLM's own KV-event wire format: batches encoded by vLLM's classes, decoded by ours."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvtune.router.engine_watch import apply_message
from kvtune.router.kv_events import KvEventError, SequenceTracker, apply_batch, decode_batch, decode_sequence
from kvtune.router.policies import EngineState
from kvtune.router.prefix_index import ReportedBlocks, block_hashes

BLOCK = 16
TOKENS = list(range(1000, 1048))  # three blocks


def vllm_payload(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> bytes:
    """A batch as vLLM's ZmqEventPublisher serializes it (msgspec msgpack of KVEventBatch)."""
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.5, events=list(events)))


def stored(hashes: list[int | bytes], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BLOCK,
                       lora_id=None, medium="GPU", lora_name=None)  # fmt: skip


def test_stored_removed_and_cleared_batches_from_vllm_update_the_view() -> None:
    view = ReportedBlocks()
    chain = block_hashes(TOKENS, BLOCK)
    first = decode_batch(vllm_payload(stored([11, 12], None, TOKENS[:32]), stored([13], 12, TOKENS[32:])))
    assert first.ts == 1.5 and len(first.events) == 2
    assert apply_batch(view, first)
    assert view.match(chain) == 3
    assert apply_batch(view, decode_batch(vllm_payload(BlockRemoved(block_hashes=[13], medium="GPU"))))
    assert view.match(chain) == 2
    assert apply_batch(view, decode_batch(vllm_payload(AllBlocksCleared())))
    assert view.match(chain) == 0


def test_a_batch_continuing_blocks_never_seen_asks_for_a_rebuild() -> None:
    view = ReportedBlocks()
    assert not apply_batch(view, decode_batch(vllm_payload(stored([21], 20, TOKENS[:16]))))


def test_sequence_numbers_and_gaps() -> None:
    assert decode_sequence((7).to_bytes(8, "big")) == 7
    with pytest.raises(KvEventError, match="8 bytes"):
        decode_sequence(b"\x01")
    tracker = SequenceTracker()
    assert tracker.next_is_contiguous(0) and tracker.next_is_contiguous(1)
    assert not tracker.next_is_contiguous(5), "batches 2-4 were dropped"
    assert tracker.next_is_contiguous(6) and tracker.gaps == 1


def test_a_message_that_is_not_a_batch_is_a_clear_error() -> None:
    with pytest.raises(KvEventError, match="not a vLLM KV-event batch"):
        decode_batch(b"\x93not msgpack")


def frames(sequence: int, *events: BlockStored | BlockRemoved | AllBlocksCleared) -> list[bytes]:
    return [b"kv@127.0.0.1@smollm2-135m", sequence.to_bytes(8, "big"), vllm_payload(*events)]


def engine() -> EngineState:
    return EngineState(name="e0", url="http://127.0.0.1:8000", capacity_blocks=64, ready=True)


def test_a_sequence_gap_makes_the_view_stale_until_the_engine_s_cache_is_known_empty() -> None:
    state, tracker = engine(), SequenceTracker()
    chain = block_hashes(TOKENS, BLOCK)
    assert apply_message(state, frames(0, stored([11, 12], None, TOKENS[:32])), tracker) is None
    assert state.reported_fresh, "batch 0 is a new engine process: its cache started empty"
    assert state.reported.match(chain) == 2
    gap = apply_message(state, frames(3, stored([13], 12, TOKENS[32:])), tracker)
    assert gap == "sequence gap (batches lost)"
    # The caller clears the view; later batches are not trusted until the cache is cleared.
    state.reported.cleared()
    state.reported_fresh = False
    assert apply_message(state, frames(4, stored([14], None, TOKENS[:16])), tracker) is None
    assert not state.reported_fresh and state.reported.match(chain) == 0
    cleared = frames(5, AllBlocksCleared(), stored([21], None, TOKENS[:16]))
    assert apply_message(state, cleared, tracker) is None
    assert state.reported_fresh and state.reported.match(chain) == 1


def test_a_restarted_engine_starts_a_fresh_view() -> None:
    state, tracker = engine(), SequenceTracker()
    apply_message(state, frames(7, stored([11], None, TOKENS[:16])), tracker)
    assert not state.reported_fresh, "a running engine's earlier blocks are unknown"
    assert apply_message(state, frames(0, stored([31], None, TOKENS[:16])), tracker) is None
    assert state.reported_fresh and state.reported.match(block_hashes(TOKENS, BLOCK)) == 1
    assert apply_message(state, [b"only", b"two"], tracker) is not None
