"""A trace's hit-rate curve read as decisions: the ideal hit rate, the knee, the smallest pool reaching a
share of the ideal, the profile's own pool, and what each costs; the same figures as a table, a plot and
JSON (kvtune trace curve), in the sweep's pruning and in the doctor's advice."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvtune.traces.curve import CurveRequest, HitRateCurve, hit_rate_curve, log_spaced, simulate
from kvtune.traces.format import Trace
from kvtune.traces.sizing import PoolCost, PoolPricing, offload_blocks
from kvtune.traces.tokens import BlockMapping, Cuts, EngineRequest, engine_requests
from kvtune.traces.window import TraceWindow, select

# Share of the ideal hit rate the recommended pool reaches unless told otherwise.
DEFAULT_TARGET_SHARE = 0.95


def curve_requests(requests: list[EngineRequest], mapping: BlockMapping) -> list[CurveRequest]:
    """Engine requests as the block pool sees them."""
    size = mapping.engine_block_size
    return [
        CurveRequest(r.block_keys(mapping), r.prompt_tokens, r.total_blocks(size), r.cached_blocks(size))
        for r in requests
    ]


@dataclass(frozen=True)
class TraceCurve:
    """A trace window replayed in engine blocks, and its curve."""

    mapping: BlockMapping
    requests: list[EngineRequest]
    pool_requests: list[CurveRequest]
    cuts: Cuts
    curve: HitRateCurve


def trace_curve(trace: Trace, mapping: BlockMapping, window: TraceWindow | None = None) -> TraceCurve:
    selected = select(trace, window or TraceWindow())
    requests, cuts = engine_requests(trace, mapping, selected)
    pool_requests = curve_requests(requests, mapping)
    return TraceCurve(
        mapping, requests, pool_requests, cuts, hit_rate_curve(pool_requests, mapping.engine_block_size)
    )


@dataclass(frozen=True)
class PoolRow:
    """One pool size of the table: its predicted hit rate, prefill per request and cost."""

    cost: PoolCost
    hit_rate: float
    computed_per_request: float
    marks: tuple[str, ...] = ()  # "smallest", "knee", "target", "profile", "everything"
    in_flight_hit_rate: float | None = None  # the block-pool replay with requests in flight


@dataclass(frozen=True)
class Offload:
    """A host-memory tier behind the pool: its blocks and the hits it adds (the curve between the sizes,
    assuming the tier keeps what the pool evicts, most recent first)."""

    gib: float
    blocks: int
    pool_blocks: int
    hit_rate_without: float
    hit_rate_with: float


@dataclass(frozen=True)
class CurveAnalysis:
    block_size: int
    trace_block_size: int
    tokens_per_block: int
    requests: int
    prompt_tokens: int
    ideal_hit_rate: float
    smallest_pool: int
    everything_pool: int
    knee_pool: int
    target_share: float
    target_pool: int
    profile_pool: int | None
    rows: list[PoolRow]
    cuts: Cuts
    bytes_per_token: int | None
    bytes_how: str
    per_gpu: str
    in_flight: int = 1
    offload: Offload | None = None
    notes: list[str] = field(default_factory=list)

    def row_for(self, pool: int) -> PoolRow | None:
        return next((row for row in self.rows if row.cost.usable_blocks == pool), None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["rows"] = [asdict(row) for row in self.rows]
        return data


def analyse(
    traced: TraceCurve,
    pricing: PoolPricing,
    *,
    target_share: float = DEFAULT_TARGET_SHARE,
    in_flight: int = 1,
    extra_pools: tuple[int, ...] = (),
    offload_gib: float | None = None,
    ranks: int = 1,
    rows: int = 12,
) -> CurveAnalysis:
    """The decisions a curve supports, priced for a profile; ROWS pools spaced in log scale, plus the marked
    ones and EXTRA_POOLS."""
    curve = traced.curve
    marks: dict[int, list[str]] = {}
    smallest, everything = curve.min_blocks, curve.max_blocks
    knee, target = curve.knee(), curve.smallest_pool_reaching(target_share)
    for pool, mark in (
        (smallest, "smallest"),
        (knee, "knee"),
        (target, "target"),
        (everything, "everything"),
    ):
        marks.setdefault(pool, []).append(mark)
    if pricing.current_usable_blocks is not None:
        marks.setdefault(pricing.current_usable_blocks, []).append("profile")
    for pool in extra_pools:
        marks.setdefault(pool, [])
    pools = sorted(set(log_spaced(smallest, everything, rows)) | set(marks))
    table = []
    for pool in pools:
        concurrent = None
        if in_flight > 1 and (pool in marks or pool in extra_pools) and pool >= smallest:
            concurrent = simulate(traced.pool_requests, curve.block_size, pool, in_flight).hit_rate
        table.append(
            PoolRow(
                pricing.cost(pool),
                curve.hit_rate(pool),
                curve.computed_per_request(pool),
                tuple(marks.get(pool, ())),
                concurrent,
            )
        )
    offload = None
    if offload_gib:
        tier = offload_blocks(offload_gib, pricing, ranks)
        base = pricing.current_usable_blocks or target
        if tier is not None:
            offload = Offload(offload_gib, tier, base, curve.hit_rate(base), curve.hit_rate(base + tier))
    notes = []
    if in_flight > 1:
        notes.append(
            f"with {in_flight} requests in flight the marked pools were replayed through vLLM's block pool, "
            "running requests holding their blocks and finishing in the order they started"
        )
    return CurveAnalysis(
        curve.block_size,
        traced.mapping.trace_block_size,
        traced.mapping.tokens_per_block,
        curve.requests,
        curve.prompt_tokens,
        curve.ideal_hit_rate,
        smallest,
        everything,
        knee,
        target_share,
        target,
        pricing.current_usable_blocks,
        table,
        traced.cuts,
        pricing.bytes_per_token,
        pricing.how,
        pricing.per_gpu,
        in_flight,
        offload,
        notes,
    )
