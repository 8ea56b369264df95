"""`kvtune doctor --trace TRACE`: the engine's pool judged by the hit-rate curve of the traffic it serves.

The residency histograms say that reuse outlasts the blocks, and estimate a larger pool from how far the
reuse gaps reach; a trace of the traffic says exactly what each pool size keeps (`kvtune.traces.curve`). So
given one, the doctor sizes the pool from the curve: the smallest pool reaching a share of the ideal hit rate,
compared with the engine's pool as vLLM reports it, and the residency check defers its size to this one.
"""

from __future__ import annotations

from kvtune import metrics
from kvtune.kv_math import KvBytes
from kvtune.observability.findings import Finding, percent, pool_fix
from kvtune.platform import NULL_BLOCKS
from kvtune.traces.curve import HitRateCurve

CHECK = "trace_curve"
# What the residency check says instead of its own size when a trace sizes the pool.
SIZED_BY_CURVE = f"the trace's curve sizes the pool ({CHECK})"


def judge(
    curve: HitRateCurve,
    source: str,
    target_share: float,
    capacity: metrics.KvCapacity,
    cache: dict[str, str],
    kv: KvBytes,
    measured: float | None,
    basis: str = "",
) -> Finding:
    """The engine's pool against the curve of SOURCE's traffic; MEASURED is the window's own hit rate."""
    pool = capacity.num_blocks - NULL_BLOCKS
    predicted, ideal = curve.hit_rate(pool), curve.ideal_hit_rate
    target = curve.smallest_pool_reaching(target_share)
    lines = [
        f"{source}: {curve.requests:,} requests, {curve.prompt_tokens:,} prompt tokens in blocks of "
        f"{curve.block_size}; ideal hit rate {percent(ideal)} (an infinite pool), every hit from "
        f"{curve.max_blocks:,} usable blocks",
        f"the engine's pool: {capacity.num_blocks:,} blocks, {pool:,} usable (one is vLLM's): predicted "
        f"{percent(predicted)} one request at a time"
        + ("" if measured is None else f"; the window's own hit rate {percent(measured)}"),
        f"{target_share:.0%} of the ideal ({percent(target_share * ideal)}) from {target:,} usable blocks "
        f"(predicted {percent(curve.hit_rate(target))})",
    ]
    if pool < curve.min_blocks:
        text = (
            f"the pool's {pool:,} usable blocks cannot hold the largest request of {source} "
            f"({curve.min_blocks:,} blocks)"
        )
    elif pool < target:
        text = (
            f"the pool keeps {percent(predicted)} of {source}'s prompt tokens cached where "
            f"{percent(curve.hit_rate(target))} is within reach ({target_share:.0%} of the ideal "
            f"{percent(ideal)})"
        )
    else:
        note = (
            ""
            if pool <= curve.max_blocks
            else f"; {pool - curve.max_blocks:,} blocks more than any hit needs"
        )
        return Finding(
            CHECK,
            "ok",
            f"the pool holds what {source} reuses: predicted {percent(predicted)} of an ideal "
            f"{percent(ideal)}{note}",
            "\n".join(lines),
        )
    fix, fix_lines = pool_fix(capacity, cache, kv, target + NULL_BLOCKS, basis)
    return Finding(CHECK, "warn", f"{text}; {fix}", "\n".join(lines + fix_lines))
