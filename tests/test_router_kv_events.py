"""The router reads vLLM's own KV-event wire format: batches encoded by vLLM's classes (in a child process,
so this test worker does not load vLLM and torch), decoded by ours."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvtune.router.engine_watch import apply_message
from kvtune.router.kv_events import KvEventError, SequenceTracker, apply_batch, decode_batch, decode_sequence
from kvtune.router.policies import EngineState
from kvtune.router.prefix_index import ReportedBlocks, block_hashes

BLOCK = 16
TOKENS = list(range(1000, 1048))  # three blocks


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> list[Any]:
    return ["stored", hashes, parent, tokens]


REMOVED_13 = ["removed", [13]]
CLEARED = ["cleared"]
# Every batch the tests use, by name: each a list of events.
BATCHES: dict[str, list[list[Any]]] = {
    "two_then_one": [stored([11, 12], None, TOKENS[:32]), stored([13], 12, TOKENS[32:])],
    "removed_13": [REMOVED_13],
    "cleared": [CLEARED],
    "orphan": [stored([21], 20, TOKENS[:16])],
    "first_two": [stored([11, 12], None, TOKENS[:32])],
    "third": [stored([13], 12, TOKENS[32:])],
    "first_again": [stored([14], None, TOKENS[:16])],
    "cleared_then_first": [CLEARED, stored([21], None, TOKENS[:16])],
    "first_11": [stored([11], None, TOKENS[:16])],
    "first_31": [stored([31], None, TOKENS[:16])],
}

ENCODER = """
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BLOCK_SIZE = int(sys.argv[1])


def event(spec):
    if spec[0] == "stored":
        _, hashes, parent, tokens = spec
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                           block_size=BLOCK_SIZE, lora_id=None, medium="GPU", lora_name=None)
    if spec[0] == "removed":
        return BlockRemoved(block_hashes=spec[1], medium="GPU")
    return AllBlocksCleared()


encoder = msgspec.msgpack.Encoder()
batches = json.load(sys.stdin)
json.dump({name: encoder.encode(KVEventBatch(ts=1.5, events=[event(e) for e in events])).hex()
           for name, events in batches.items()}, sys.stdout)
"""


@pytest.fixture(scope="module")
def payloads() -> dict[str, bytes]:
    """BATCHES as vLLM's ZmqEventPublisher serializes them (msgspec msgpack of its KVEventBatch)."""
    done = subprocess.run([sys.executable, "-c", ENCODER, str(BLOCK)], input=json.dumps(BATCHES),
                          capture_output=True, text=True, check=True, timeout=300)  # fmt: skip
    return {name: bytes.fromhex(value) for name, value in json.loads(done.stdout).items()}


def test_stored_removed_and_cleared_batches_from_vllm_update_the_view(payloads: dict[str, bytes]) -> None:
    view = ReportedBlocks()
    chain = block_hashes(TOKENS, BLOCK)
    first = decode_batch(payloads["two_then_one"])
    assert first.ts == 1.5 and len(first.events) == 2
    assert apply_batch(view, first) is None
    assert view.match(chain) == 3
    assert apply_batch(view, decode_batch(payloads["removed_13"])) is None
    assert view.match(chain) == 2
    assert apply_batch(view, decode_batch(payloads["cleared"])) is None
    assert view.match(chain) == 0


def test_a_batch_continuing_blocks_never_seen_asks_for_a_rebuild(payloads: dict[str, bytes]) -> None:
    view = ReportedBlocks()
    assert (
        apply_batch(view, decode_batch(payloads["orphan"]))
        == "a block stored after a parent the view never saw"
    )


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


def frames(sequence: int, payload: bytes) -> list[bytes]:
    return [b"kv@127.0.0.1@smollm2-135m", sequence.to_bytes(8, "big"), payload]


def engine() -> EngineState:
    return EngineState(name="e0", url="http://127.0.0.1:8000", capacity_blocks=64, ready=True)


def test_a_sequence_gap_makes_the_view_stale_until_the_engine_s_cache_is_known_empty(
    payloads: dict[str, bytes],
) -> None:
    state, tracker = engine(), SequenceTracker()
    chain = block_hashes(TOKENS, BLOCK)
    assert apply_message(state, frames(0, payloads["first_two"]), tracker) is None
    assert state.reported_fresh, "batch 0 is a new engine process: its cache started empty"
    assert state.reported.match(chain) == 2
    gap = apply_message(state, frames(3, payloads["third"]), tracker)
    assert gap == "sequence gap (batches lost)"
    # The caller clears the view; later batches are not trusted until the cache is cleared.
    state.reported.cleared()
    state.reported_fresh = False
    assert apply_message(state, frames(4, payloads["first_again"]), tracker) is None
    assert not state.reported_fresh and state.reported.match(chain) == 0
    cleared = frames(5, payloads["cleared_then_first"])
    assert apply_message(state, cleared, tracker) is None
    assert state.reported_fresh and state.reported.match(chain) == 1


def test_a_restarted_engine_starts_a_fresh_view(payloads: dict[str, bytes]) -> None:
    state, tracker = engine(), SequenceTracker()
    apply_message(state, frames(7, payloads["first_11"]), tracker)
    assert not state.reported_fresh, "a running engine's earlier blocks are unknown"
    assert apply_message(state, frames(0, payloads["first_31"]), tracker) is None
    assert state.reported_fresh and state.reported.match(block_hashes(TOKENS, BLOCK)) == 1
    assert apply_message(state, [b"only", b"two"], tracker) is not None
