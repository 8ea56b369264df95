"""Which part of a trace to replay, and how fast: a window of it, a share of its conversations, a time scale.

Thinning a trace by dropping single requests would cut conversations in the middle and lower the reuse the
pool is being sized for; kvtune keeps or drops whole conversations. A request belongs to the conversation of
the latest earlier request whose whole prompt (its full blocks) it starts with: a next turn resends the
conversation so far. A request that starts no earlier prompt opens a conversation of its own.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvtune.traces.format import Trace, TraceError


@dataclass(frozen=True)
class TraceWindow:
    """The part of a trace a run replays."""

    start: int = 0  # index of the first request
    count: int | None = None  # at most this many requests (after sampling)
    duration_s: float | None = None  # only requests within this many trace seconds of the first
    sample: float = 1.0  # share of conversations kept, 0 < sample <= 1
    time_scale: float = 1.0  # the trace's gaps multiplied by this (0.5: twice as fast)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.start < 0:
            raise TraceError(f"trace start {self.start} must be 0 or more")
        if self.count is not None and self.count < 1:
            raise TraceError(f"trace count {self.count} must be at least 1")
        if self.duration_s is not None and not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise TraceError(f"trace duration {self.duration_s} must be a positive number of seconds")
        if not (math.isfinite(self.sample) and 0 < self.sample <= 1):
            raise TraceError(f"trace sample {self.sample} must be a share above 0 and at most 1")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise TraceError(f"time scale {self.time_scale} must be a positive number")


def conversations(trace: Trace, indices: list[int]) -> list[int]:
    """The conversation of each of INDICES (a number per conversation, in order of first appearance)."""
    ends: dict[int, int] = {}  # the last full block id of a request's prompt -> its conversation
    found: list[int] = []
    for index in indices:
        request = trace.requests[index]
        full = request.full_blocks(trace.block_size)
        conversation = next(
            (ends[block_id] for block_id in reversed(request.hash_ids[:full]) if block_id in ends), None
        )
        if conversation is None:
            conversation = len(set(found))
        found.append(conversation)
        if full:
            ends[request.hash_ids[full - 1]] = conversation
    return found


def select(trace: Trace, window: TraceWindow) -> list[tuple[int, float]]:
    """(trace index, intended send time in seconds from the window's first request) of each request kept."""
    if window.start >= len(trace.requests):
        raise TraceError(
            f"trace start {window.start} is past the trace's {len(trace.requests):,} requests; "
            "use a smaller one"
        )
    first_ms = trace.requests[window.start].timestamp_ms
    indices = [
        i
        for i in range(window.start, len(trace.requests))
        if window.duration_s is None or trace.requests[i].timestamp_ms - first_ms <= window.duration_s * 1000
    ]
    if window.sample < 1:
        rng = random.Random(window.seed)
        owners = conversations(trace, indices)
        kept = {owner for owner in sorted(set(owners)) if rng.random() < window.sample}
        if not kept:  # a tiny sample of a short trace: keep the first conversation rather than nothing
            kept = {owners[0]}
        indices = [i for i, owner in zip(indices, owners, strict=True) if owner in kept]
    if window.count is not None:
        indices = indices[: window.count]
    start_ms = trace.requests[indices[0]].timestamp_ms
    return [(i, (trace.requests[i].timestamp_ms - start_ms) / 1000 * window.time_scale) for i in indices]
