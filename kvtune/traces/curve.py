"""The prefix-cache hit rate of every pool size for one traffic, in one pass, before any engine starts.

vLLM's prefix cache (0.32, `vllm/v1/core/block_pool.py`, `kv_cache_manager.py`) is an LRU over free blocks
with deterministic rules, and this module follows them:
- only whole blocks are cached and matched, chained: a block hits only when every block before it does;
- a prompt never hits its own last token: at most (prompt_tokens - 1) // block_size blocks hit, so when every
  block of a whole-block prompt is cached, the last one is computed again (into a new block: the old copy
  stays cached beside it until evicted);
- a finished request's blocks return to the free queue tail first (`reversed(blocks)`): its last blocks,
  output included, are evicted before its first ones, which are what the next turn reuses;
- a block that never filled (the request's last, partial one) holds no hash: it goes to the front of the
  queue and is the next one taken, so it displaces no cached block (`BlockPool.free_blocks`).

With one request at a time, the order in which blocks leave the queue does not depend on the pool's size
(request after request, and within one request its position), so the pool of C blocks holds exactly the C
most recent blocks in that order, less the partial block the last request left at the front: LRU's
inclusion property. A block's stack depth (how many blocks are more
recent) then decides every pool size at once: block j of a prompt hits in a pool of C blocks when the deepest
of blocks 0..j is shallower than C. One pass over the trace with a Fenwick tree gives the depths; their
histogram gives the curve. Checked against vLLM 0.32's own counters on the CPU build
(tests/test_trace_curve_real.py and `make bench-trace`).

With requests in flight, running requests pin their blocks and finish out of arrival order: `simulate` replays
vLLM's block pool itself at one pool size with up to N requests running, finishing in the order they started
(the model's simplification, stated with its measured error in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CurveRequest:
    """One request as the pool sees it: its whole prompt blocks, its prompt size and every block it holds."""

    keys: tuple[Hashable, ...]  # the prompt's whole blocks (chained: a key names its whole prefix)
    prompt_tokens: int
    total_blocks: int  # prompt and output blocks it holds at its end
    cached_blocks: int  # of which full, so hashed and cached when freed (the rest: one partial block or none)

    def hittable(self, block_size: int) -> int:
        return hittable_blocks(self.prompt_tokens, len(self.keys), block_size)


def hittable_blocks(prompt_tokens: int, whole_blocks: int, block_size: int) -> int:
    """Blocks of a prompt that may hit: whole blocks, never the one holding the prompt's last token (vLLM
    0.32 caps a hit at prompt_tokens - 1 tokens, `KVCacheManager.get_computed_blocks`)."""
    return min(whole_blocks, (prompt_tokens - 1) // block_size)


class _Fenwick:
    """Counts of live blocks by the time they were last used: how many are more recent than a given one."""

    def __init__(self, size: int) -> None:
        self.tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        while index < len(self.tree):
            self.tree[index] += delta
            index += index & -index

    def prefix(self, index: int) -> int:
        total = 0
        while index > 0:
            total += self.tree[index]
            index -= index & -index
        return total


@dataclass(frozen=True)
class HitRateCurve:
    """Hit tokens at every pool size (in usable blocks: vLLM keeps one more block back, its null block)."""

    block_size: int
    requests: int
    prompt_tokens: int
    min_blocks: int  # the largest request's blocks: no smaller pool serves the trace
    depths: tuple[int, ...]  # sorted: the depth at which each block that can ever hit stops hitting

    @property
    def max_blocks(self) -> int:
        """The smallest pool at which every block that can hit does (no larger pool hits more)."""
        return max(self.min_blocks, self.depths[-1] + 1 if self.depths else 0)

    def hit_tokens(self, pool_blocks: int) -> int:
        return bisect.bisect_left(self.depths, pool_blocks) * self.block_size

    def hit_rate(self, pool_blocks: int) -> float:
        return self.hit_tokens(pool_blocks) / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        """An infinite pool's: every block seen before hits."""
        return len(self.depths) * self.block_size / self.prompt_tokens if self.prompt_tokens else 0.0

    def computed_per_request(self, pool_blocks: int) -> float:
        """Prompt tokens prefilled per request (the rest come from the cache)."""
        return (self.prompt_tokens - self.hit_tokens(pool_blocks)) / self.requests if self.requests else 0.0

    def smallest_pool_reaching(self, share_of_ideal: float) -> int:
        """The smallest pool whose hit rate is at least SHARE_OF_IDEAL of the ideal one."""
        # The blocks that must hit, and the depth at which the last of them (in sorted order) starts to.
        reached = min(math.ceil(share_of_ideal * len(self.depths) - 1e-9), len(self.depths))
        pool = self.depths[reached - 1] + 1 if reached > 0 else 0
        return max(self.min_blocks, pool)

    def knee(self) -> int:
        """Where more pool stops paying: the point of the curve farthest above the chord from the smallest
        pool to the one that holds everything (Kneedle's rule, on pool sizes spaced evenly in log scale, as
        pools are chosen: each step doubles)."""
        low, high = self.min_blocks, self.max_blocks
        if high <= low:
            return low
        sizes = log_spaced(low, high, 200)
        h_low, h_high = self.hit_rate(low), self.hit_rate(high)
        if h_high <= h_low:
            return low
        span = math.log(high) - math.log(low)

        def lift(size: int) -> float:
            x = (math.log(size) - math.log(low)) / span
            return (self.hit_rate(size) - h_low) / (h_high - h_low) - x

        return max(sizes, key=lift)


def log_spaced(low: int, high: int, count: int) -> list[int]:
    """About COUNT whole sizes from LOW to HIGH, evenly spaced in log scale, both ends included."""
    if high <= low:
        return [low]
    ratio = (high / low) ** (1 / max(count - 1, 1))
    sizes = {low, high}
    value = float(low)
    while value < high:
        sizes.add(round(value))
        value *= ratio
    return sorted(size for size in sizes if low <= size <= high)


def hit_rate_curve(requests: Sequence[CurveRequest], block_size: int) -> HitRateCurve:
    """The curve of REQUESTS served one at a time, in order (module docstring: the rules and why one pass)."""
    clock = _Fenwick(sum(r.total_blocks + len(r.keys) for r in requests) + 1)
    last_used: dict[Hashable, int] = {}
    live = now = 0
    depths: list[int] = []
    at_front = 0  # the partial block the previous request left at the queue's front: one cached block less
    for request in requests:
        deepest = -1
        for key in request.keys[: request.hittable(block_size)]:
            used = last_used.get(key)
            if used is None:
                break  # a miss: no later block of this prompt can hit at any size
            deepest = max(deepest, live - clock.prefix(used) + at_front)
            depths.append(deepest)
        at_front = request.total_blocks - request.cached_blocks
        # The request's cached blocks return to the queue: its own (output blocks) first, then its prompt
        # blocks from the last to the first, so the first is the most recent.
        unshared = max(request.cached_blocks - len(request.keys), 0)
        for _ in range(unshared):
            now += 1
            clock.add(now, 1)
        live += unshared
        hittable = request.hittable(block_size)
        for position in range(len(request.keys) - 1, -1, -1):
            key = request.keys[position]
            used = last_used.get(key)
            # A block that could hit was moved, not copied. The last block of a whole-block prompt is computed
            # again into a new block: its old copy keeps its place until evicted.
            if used is not None and position < hittable:
                clock.add(used, -1)
                live -= 1
            now += 1
            clock.add(now, 1)
            live += 1
            last_used[key] = now
    depths.sort()
    return HitRateCurve(
        block_size,
        len(requests),
        sum(r.prompt_tokens for r in requests),
        max((r.total_blocks for r in requests), default=0),
        tuple(depths),
    )


@dataclass(frozen=True)
class Simulated:
    """What one pool served in a replay of vLLM's block pool."""

    pool_blocks: int
    in_flight: int
    hit_tokens: int
    prompt_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate(
    requests: Sequence[CurveRequest], block_size: int, pool_blocks: int, in_flight: int = 1
) -> Simulated:
    """REQUESTS through a pool of POOL_BLOCKS usable blocks with up to IN_FLIGHT running at once, each
    request finishing in the order they started; a request waits for running ones to finish until its blocks
    are free. vLLM's rules as in the module docstring; a block's cached copies are looked up oldest first."""
    free: OrderedDict[int, None] = OrderedDict((slot, None) for slot in range(pool_blocks))
    key_of: list[Hashable | None] = [None] * pool_blocks
    copies: dict[Hashable, list[int]] = {}
    holders = [0] * pool_blocks
    running: list[list[int]] = []
    hits = evictions = 0

    def finish(blocks: list[int]) -> None:
        for slot in reversed(blocks):
            holders[slot] -= 1
            if holders[slot] == 0:
                free[slot] = None
                if key_of[slot] is None:  # never filled: taken first
                    free.move_to_end(slot, last=False)

    for request in requests:
        if request.total_blocks > pool_blocks:
            raise ValueError(
                f"a request holds {request.total_blocks} blocks, more than the pool's {pool_blocks}"
            )
        if len(running) >= in_flight:
            finish(running.pop(0))
        held: list[int] = []
        for prefix_key in request.keys[: request.hittable(block_size)]:
            found = copies.get(prefix_key)
            if not found:
                break
            slot = found[0]
            if holders[slot] == 0:
                del free[slot]
            holders[slot] += 1
            held.append(slot)
        hits += len(held)
        need = request.total_blocks - len(held)
        while len(free) < need and running:
            finish(running.pop(0))
        for position in range(len(held), len(held) + need):
            slot, _ = free.popitem(last=False)
            old = key_of[slot]
            if old is not None:
                copies[old].remove(slot)
                if not copies[old]:
                    del copies[old]
                evictions += 1
            key: Hashable | None = None
            if position < len(request.keys):
                key = request.keys[position]
            elif position < request.cached_blocks:
                key = object()  # an output block: cached, never matched
            key_of[slot] = key
            if key is not None:
                copies.setdefault(key, []).append(slot)
            holders[slot] = 1
            held.append(slot)
        running.append(held)
    return Simulated(
        pool_blocks, in_flight, hits * block_size, sum(r.prompt_tokens for r in requests), evictions
    )
