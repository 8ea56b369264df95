"""The router's views of engine caches: chained block hashes, the sent-blocks LRU and the KV-event view."""

from __future__ import annotations

import pytest

from kvtune.router.prefix_index import ROOT_HASH, ReportedBlocks, SentBlocks, block_hashes, chain_hash

BLOCK = 4


def test_a_block_hash_stands_for_the_whole_prefix_before_it() -> None:
    shared = list(range(8))
    a = block_hashes([*shared, 100, 101, 102, 103, 7], BLOCK)
    b = block_hashes([*shared, 200, 201, 202, 203], BLOCK)
    assert len(a) == 3, "the partial last block is not a block"
    assert a[:2] == b[:2] and a[2] != b[2]
    # The same tokens after another prefix are another block.
    assert block_hashes([9, 9, 9, 9, *shared], BLOCK)[1] != a[0]
    assert a[0] == chain_hash(ROOT_HASH, shared[:BLOCK])
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(shared, 0)


def test_sent_blocks_match_the_longest_chain_and_forget_the_oldest_beyond_capacity() -> None:
    sent = SentBlocks(capacity=4)
    first = block_hashes(list(range(12)), BLOCK)  # 3 blocks
    sent.sent(first)
    assert sent.match(first) == 3
    assert sent.match(block_hashes([*range(8), 50, 51, 52, 53], BLOCK)) == 2
    assert sent.match(block_hashes([1, *range(11)], BLOCK)) == 0
    sent.sent(block_hashes([70, 71, 72, 73, 74, 75, 76, 77], BLOCK))  # 2 more: one of the first chain's goes
    assert len(sent) == 4
    assert sent.match(first) == 2, "the chain's end goes first (as vLLM evicts), its start stays"
    sent.sent(block_hashes([80, 81, 82, 83, 84, 85, 86, 87], BLOCK))  # 2 more again
    assert sent.match(first) == 0, "a chain whose first block was evicted matches nothing"
    sent.sent(first[:1])  # used again: now the most recent
    assert sent.match(first) == 1
    with pytest.raises(ValueError, match="capacity"):
        SentBlocks(capacity=0)


def test_reported_blocks_follow_stored_removed_and_cleared_events() -> None:
    view = ReportedBlocks()
    tokens = list(range(12))
    chain = block_hashes(tokens, BLOCK)
    assert view.stored([b"e1", b"e2"], None, tokens[:8], BLOCK)
    assert view.stored([b"e3"], b"e2", tokens[8:], BLOCK), "a batch continuing a reported parent"
    assert view.match(chain) == 3
    view.removed([b"e2"])
    assert view.match(chain) == 1, "an evicted middle block ends the match there"
    view.removed([b"unknown"])  # an eviction of a block never reported changes nothing
    assert len(view) == 2
    view.cleared()
    assert view.match(chain) == 0 and len(view) == 0


def test_an_event_whose_parent_was_never_reported_is_refused() -> None:
    view = ReportedBlocks()
    assert not view.stored([b"e9"], b"missing-parent", list(range(4)), BLOCK), "events were lost: resync"
    assert not view.stored([b"e1", b"e2"], None, list(range(5)), BLOCK), "tokens for one block, two hashes"
    assert len(view) == 0


def test_the_same_prefix_stored_under_two_engine_hashes_stays_until_both_are_removed() -> None:
    view = ReportedBlocks()
    tokens = list(range(4))
    assert view.stored([1], None, tokens, BLOCK) and view.stored([2], None, tokens, BLOCK)
    view.removed([1])
    assert view.match(block_hashes(tokens, BLOCK)) == 1
    view.removed([2])
    assert view.match(block_hashes(tokens, BLOCK)) == 0


def test_blocks_just_sent_count_as_held_until_the_engine_reports_them_or_they_expire() -> None:
    view = ReportedBlocks(expect_s=60)
    tokens = list(range(12))
    chain = block_hashes(tokens, BLOCK)
    view.expect(chain, now=0)  # sent; the engine has not computed them yet
    assert view.match(chain, now=1) == 3, "a second request with this new prefix finds it on this engine"
    assert view.match(chain, now=61) == 0, "never reported: the expectation lapses"
    view.expect(chain, now=100)
    assert view.stored([b"e1", b"e2", b"e3"], None, tokens, BLOCK)
    assert view.match(chain, now=200) == 3, "reported now: held whatever the clock"
    view.removed([b"e2"])
    assert view.match(chain, now=101) == 1, "evicted after being reported: gone, expectation or not"
    view.expect(chain, now=300)
    view.cleared()
    assert view.match(chain, now=301) == 0, "a reset drops what was expected too"
