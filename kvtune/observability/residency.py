"""Are KV blocks evicted before the traffic comes back for them? Judged from vLLM's block residency
histograms over the doctor's window (`kvtune.metrics_window` gathers them), with the pool size that keeps
the reuse the traffic makes.

What the histograms can say (vLLM 0.32; `kvtune.metrics` has the details): all three are observed when a
sampled block is handed out again, and a reuse gap is the time between two prefix-cache hits of a block
that was still cached. A reuse that comes after its block was evicted leaves no gap (its prefix comes back
as a new block), so the gaps seen are those of reuses that outlasted their wait, and they stop near the
time an idle block survives. "Median idle before eviction below the median reuse gap" therefore almost
never holds, even on a pool far too small: measured on this project's CPU engine (4 prefixes of 12 blocks
asked for in random order, 36-block pool), hit rate 60%, median reuse gap 0.98 s, median idle before
eviction 3.16 s. What does show is the gaps' upper tail running into that horizon: p90 gap 4.6 s. So the
check compares the reuse gaps' p90 with the median idle time before eviction
(`metrics_window.REUSE_GAP_QUANTILE`, `IDLE_QUANTILE`, the alert's own).

Two more facts keep it honest. vLLM hands a request's last, partly filled block (it has no hash: nothing
can hit it) to the next allocation first, recorded as an eviction after about one request's time; on
traffic of few blocks per request these pull the median idle time down on a pool that loses nothing, so
the check also wants the hit rate below healthy (reuse lost is hits lost). And fewer than
`alerts.RESIDENCY_MIN_OBSERVATIONS` sampled evictions or gaps are too few to read a quantile from.

The size: under LRU at a fixed arrival of new blocks, the time a block survives idle grows in proportion
to the pool. The gaps seen are cut at that horizon, so the traffic's reach at least as far as their p90:
the pool is grown until blocks survive `KEEP` times that, by KEEP x p90 gap / median idle. Fewer misses
then mean fewer new blocks, so the horizon grows faster than the pool and the factor errs large; the
doctor run again on the grown pool says whether reuse still reaches the horizon.
"""

from __future__ import annotations

import math

from kvtune import metrics
from kvtune.kv_math import KvBytes
from kvtune.metrics_window import IDLE_QUANTILE, REUSE_GAP_QUANTILE, WindowFacts
from kvtune.observability import alerts
from kvtune.observability.findings import Finding, percent, pool_fix, seconds

CHECK = "residency"
# How many times the longest reuse gaps seen a grown pool keeps a block idle: they were cut at the old
# horizon, so the traffic's reach past it.
KEEP = 2.0
LEAST = alerts.RESIDENCY_MIN_OBSERVATIONS
TURN_ON = (
    "vLLM exports no KV block residency histograms: set kv_cache_metrics: true in the profile (vLLM's "
    "--kv-cache-metrics; kv_cache_metrics_sample: 1.0 follows every block, where vLLM's default follows 1%) "
    "to see how long blocks stay cached against how long reuses wait"
)


def _q(quantile: float) -> str:
    return f"p{quantile * 100:g}"


def judge(
    facts: WindowFacts,
    capacity: metrics.KvCapacity | None,
    cache: dict[str, str],
    kv: KvBytes,
    basis: str = "",
    sized_elsewhere: str | None = None,
) -> Finding | None:
    """The residency finding for a window's facts (cleared of unknown ones); None when there is nothing to
    say (no histograms and no traffic). SIZED_ELSEWHERE: what sizes the pool instead of this check's
    estimate (a trace's curve), said in its place."""
    if not facts.residency_exported:
        return Finding(CHECK, "ok", TURN_ON) if facts.traffic else None
    evicted, reused = facts.evicted_blocks, facts.reuse_gaps
    idle, gap = facts.idle_before_evict_s, facts.reuse_gap_s
    if evicted < LEAST or idle is None:
        if not evicted and not facts.traffic:
            return None
        return Finding(
            CHECK,
            "ok",
            f"{evicted:,.0f} sampled KV blocks evicted in the window: too few (under {LEAST}) to judge how "
            "long blocks stay cached",
        )
    horizon = f"blocks are evicted after a median {seconds(idle)} idle ({evicted:,.0f} sampled evictions" + (
        f", lifetime median {seconds(facts.block_lifetime_median_s)})"
        if facts.block_lifetime_median_s is not None
        else ")"
    )
    if idle <= 0 or not math.isfinite(idle):
        return Finding(CHECK, "ok", f"{horizon}: no reuse can be compared with that")
    if reused < LEAST or gap is None:
        return Finding(
            CHECK,
            "ok",
            f"{horizon}; {reused:,.0f} reuse gaps, too few (under {LEAST}) to compare with it: vLLM counts a "
            "block's gaps when it is evicted, so reused blocks that stay cached show none",
        )
    gaps_text = (
        f"reuse gap: median {seconds(facts.reuse_gap_median_s or 0.0)}, {_q(REUSE_GAP_QUANTILE)} "
        f"{seconds(gap)} over {reused:,.0f} gaps"
    )
    compared = f"{_q(REUSE_GAP_QUANTILE)} reuse gap {seconds(gap)}"
    if gap < idle:
        return Finding(
            CHECK,
            "ok",
            f"reuse comes within residency: {compared} < {_q(IDLE_QUANTILE)} idle before eviction "
            f"{seconds(idle)}",
            f"{horizon}\n{gaps_text}",
        )
    reaches = (
        f"reuse reaches the eviction horizon ({compared} >= {_q(IDLE_QUANTILE)} idle before eviction "
        f"{seconds(idle)})"
    )
    # The hit rate says whether reaching it costs anything; a restart or a skipped sample leaves it unknown.
    rate = None if {"hits", "queries"} & set(facts.unknown) else facts.hit_rate
    if rate is None:
        return Finding(
            CHECK,
            "ok",
            f"{reaches}; the hit rate is unknown, so what that costs is too",
            f"{horizon}\n{gaps_text}",
        )
    if rate >= alerts.PREFIX_CACHE_HIT_RATE_HEALTHY:
        return Finding(
            CHECK,
            "ok",
            f"{reaches}, but {percent(rate)} of prompt tokens hit: little is lost",
            f"{horizon}\n{gaps_text}",
        )
    return _evictions_before_reuse(
        facts, rate, capacity, cache, kv, basis, horizon, gaps_text, sized_elsewhere
    )


def _evictions_before_reuse(
    facts: WindowFacts,
    rate: float,
    capacity: metrics.KvCapacity | None,
    cache: dict[str, str],
    kv: KvBytes,
    basis: str,
    horizon: str,
    gaps_text: str,
    sized_elsewhere: str | None = None,
) -> Finding:
    idle, gap = facts.idle_before_evict_s or 0.0, facts.reuse_gap_s or 0.0
    factor = KEEP * gap / idle
    keep_s = KEEP * gap
    lines = [
        horizon,
        f"{gaps_text}; hit rate {percent(rate)} (vLLM records a gap only for a block that "
        "survived it, so the gaps stop near the eviction horizon)",
        f"under LRU at a fixed arrival of new blocks a block's idle time before eviction grows in proportion "
        f"to the pool: to keep blocks {seconds(keep_s)} idle ({number(KEEP)} x the {_q(REUSE_GAP_QUANTILE)} "
        f"gap), {number(KEEP)} x {seconds(gap)} / {seconds(idle)} = {factor:.2f}x the pool",
    ]
    text = (
        f"evictions before reuse: blocks are evicted after a median {seconds(idle)} idle while reuses wait "
        f"up to {seconds(gap)} ({_q(REUSE_GAP_QUANTILE)} of {facts.reuse_gaps:,.0f} gaps) and "
        f"{percent(rate)} of prompt tokens hit: prefixes asked for again later than "
        f"~{seconds(idle)} are prefilled again"
    )
    if sized_elsewhere is not None:
        return Finding(CHECK, "warn", f"{text}; {sized_elsewhere}", "\n".join(lines[:2]))
    if capacity is None:
        return Finding(CHECK, "warn", f"{text}; grow the KV pool {factor:.1f}x", "\n".join(lines))
    target = math.ceil(round(capacity.num_blocks * factor, 6))  # 728 x 36/7 is 3,744, not 3,744.0000000000005
    lines.append(
        f"{capacity.num_blocks:,} blocks x {factor:.2f} = {target:,} blocks of {capacity.block_size} = "
        f"{target * capacity.block_size:,} tokens"
    )
    fix, fix_lines = pool_fix(capacity, cache, kv, target, basis)
    return Finding(CHECK, "warn", f"{text}; {fix}", "\n".join(lines + fix_lines))


def number(value: float) -> str:
    return alerts.number_text(value)
