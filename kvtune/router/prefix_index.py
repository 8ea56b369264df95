"""Which prompt prefixes each engine holds, in KV blocks: the router's two views of the engines' caches.

A prompt is cut into blocks of the engines' block size (vLLM caches only full blocks) and each block is
named by a hash chained to its parent's, so a block's hash stands for the whole prefix up to it and the
longest run of leading hashes an engine holds is the prefix it would not prefill again.

- `SentBlocks` is what the router has sent to an engine (the `prefix` policy): an LRU sized from the
  engine's KV capacity in blocks, since the engine's own cache can hold no more. It cannot see evictions
  caused by other traffic, only guess them by that bound.
- `ReportedBlocks` is what an engine says it holds, from vLLM's KV events (the `kv_events` policy):
  `BlockStored` carries the tokens of each stored block, so the router names them with its own chain
  hash (no need to reproduce vLLM's hash function) and keeps vLLM's hash -> its own for `BlockRemoved`.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROOT_HASH = 0
# chain_hash packs each token id into 4 signed bytes; every vocabulary is far smaller.
MAX_TOKEN_ID = 2**31 - 1
# Blocks sent but not yet reported, kept at most (oldest dropped): without a bound, many long prompts
# arriving within `expect_s` would grow the router's memory without end. A prompt's blocks beyond an
# engine's pool cannot all be held anyway, and a few hundred thousand blocks exceed any pool kvtune runs.
MAX_EXPECTED_BLOCKS = 1 << 18


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a block of TOKENS following the block PARENT (ROOT_HASH for the first)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    digest.update(b"".join(token.to_bytes(4, "little", signed=True) for token in tokens))
    return int.from_bytes(digest.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """The chained hashes of the full blocks of TOKENS (a partial last block is never cached)."""
    if block_size <= 0:
        raise ValueError(f"block_size: {block_size} is not a positive number of tokens")
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def matched_blocks(chain: Sequence[int], held: set[int] | OrderedDict[int, None] | dict[int, int]) -> int:
    """How many leading blocks of CHAIN are held: a block counts only after all its parents."""
    count = 0
    for block in chain:
        if block not in held:
            break
        count += 1
    return count


@dataclass
class SentBlocks:
    """The blocks the router has sent one engine, least recently used first, at most `capacity`."""

    capacity: int
    _blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"capacity: {self.capacity} is not a positive number of KV blocks")

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, chain: Sequence[int]) -> int:
        return matched_blocks(chain, self._blocks)

    def sent(self, chain: Sequence[int]) -> None:
        """CHAIN went to this engine: its blocks are the most recently used, the oldest beyond capacity go.

        Within the chain the first block counts as the most recent: vLLM frees a finished request's blocks
        last block first, so the engine evicts a prefix from its end and keeps its start longest."""
        for block in reversed(chain):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class ReportedBlocks:
    """The blocks one engine reports holding, from its KV events, under the router's chain hashes.

    Blocks of a request the router has just sent count as held until the engine's events speak of them
    (or `expect_s` at most): vLLM reports a prompt's blocks only once it has computed them, and a request
    with the same new prefix arriving meanwhile would otherwise find it nowhere and be sent elsewhere."""

    expect_s: float = 60.0
    _ours_by_engine_hash: dict[int | bytes, int] = field(default_factory=dict)
    _held: dict[int, int] = field(default_factory=dict)  # our hash -> how many engine blocks carry it
    _expected: OrderedDict[int, float] = field(default_factory=OrderedDict)  # our hash -> until (monotonic)

    def __len__(self) -> int:
        return len(self._held)

    @property
    def engine_blocks(self) -> int:
        """Blocks the engine's events say it holds, under the engine's own hashes."""
        return len(self._ours_by_engine_hash)

    def match(self, chain: Sequence[int], now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        count = 0
        for block in chain:
            if block not in self._held and self._expected.get(block, now) <= now:
                break
            count += 1
        return count

    def expect(self, chain: Sequence[int], now: float | None = None) -> None:
        """CHAIN was just sent to the engine: its blocks count as held until reported (or expired)."""
        now = time.monotonic() if now is None else now
        while self._expected and next(iter(self._expected.values())) <= now:
            self._expected.popitem(last=False)
        for block in chain:
            if block not in self._held:
                self._expected[block] = now + self.expect_s
                self._expected.move_to_end(block)
        while len(self._expected) > MAX_EXPECTED_BLOCKS:
            self._expected.popitem(last=False)

    def stored(
        self,
        engine_hashes: Sequence[int | bytes],
        parent_engine_hash: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
    ) -> bool:
        """A `BlockStored` event; False (nothing recorded) when its parent block was never reported, which
        means events were lost and the view must be rebuilt."""
        if parent_engine_hash is None:
            parent = ROOT_HASH
        elif parent_engine_hash in self._ours_by_engine_hash:
            parent = self._ours_by_engine_hash[parent_engine_hash]
        else:
            return False
        ours = block_hashes(token_ids, block_size, parent)
        if len(ours) != len(engine_hashes):
            return False
        for engine_hash, our_hash in zip(engine_hashes, ours, strict=True):
            if engine_hash not in self._ours_by_engine_hash:
                self._held[our_hash] = self._held.get(our_hash, 0) + 1
            self._ours_by_engine_hash[engine_hash] = our_hash
            self._expected.pop(our_hash, None)
        return True

    def removed(self, engine_hashes: Iterable[int | bytes]) -> None:
        """A `BlockRemoved` event: the engine evicted these blocks."""
        for engine_hash in engine_hashes:
            our_hash = self._ours_by_engine_hash.pop(engine_hash, None)
            if our_hash is None:
                continue
            left = self._held.get(our_hash, 0) - 1
            if left > 0:
                self._held[our_hash] = left
            else:
                self._held.pop(our_hash, None)

    def cleared(self) -> None:
        """An `AllBlocksCleared` event (a prefix-cache reset): the engine holds nothing."""
        self._ours_by_engine_hash.clear()
        self._held.clear()
        self._expected.clear()
