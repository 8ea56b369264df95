"""A trace workload's hit-rate curve where the sweep decides: pools pruned before any engine starts, and the
report's curve with each trial's measured hit rate on it.

Two rules, both before any engine starts (kvtune.traces.curve says what the curve predicts):
- a pool that cannot hold the trace's running requests (its largest request, or `users` requests of the mean
  size where max_num_seqs lets them run) is pruned with the arithmetic, as for the generated workloads;
- of configs that differ only in their KV budget, a larger pool whose predicted hit rate is within the spec's
  `curve_noise` of a smaller one's is not measured: the curve says it buys nothing the sweep could see.
A text trace (prompts, not hash ids) has no blocks until a tokenizer makes them: convert it with `kvtune trace
convert` to be pruned by its curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtune.files import write_atomic
from kvtune.loadgen.trace_workload import TraceArgs, read_trace_file, selected
from kvtune.platform import NULL_BLOCKS
from kvtune.profile import EngineProfile
from kvtune.sweep.spec import SweepSpec
from kvtune.traces.analysis import TraceCurve, analyse, curve_requests
from kvtune.traces.curve import hit_rate_curve
from kvtune.traces.format import Trace
from kvtune.traces.plot import Measured, curve_figure
from kvtune.traces.sizing import pricing
from kvtune.traces.tokens import BlockMapping, engine_requests

# The report's plot of the curve: name, title (alt text) and how to read it, as sweep/plots.py lists its own.
CURVE_PLOT = (
    "curve",
    "The trace's hit-rate curve with each config's measured hit rate",
    "The line is the hit rate the trace's curve predicts at each pool size (requests one at a time); red "
    "dots are what each measured config's engine reported at its pool, under the sweep's load.",
)
# The knobs that set a pool's size: configs differing only in these are one config to every other knob.
BUDGET_KNOBS = ("num_gpu_blocks_override", "kv_cache_memory_bytes", "gpu_memory_utilization")


@dataclass
class TraceCurves:
    """The spec's trace, its selected requests, and a curve per engine block size and max_model_len."""

    trace: Trace
    chosen: list[tuple[int, float]]
    args: TraceArgs
    _curves: dict[tuple[int, int | None], TraceCurve]

    @classmethod
    def of(cls, spec: SweepSpec) -> TraceCurves | None:
        """The curves of SPEC's workload; None when it is not a hash-block trace."""
        if spec.workload.name != "trace":
            return None
        args = TraceArgs.of(spec.workload.args, spec.seed)
        file = read_trace_file(args, spec.workload.max_tokens)
        if file.texts is not None:
            return None
        return cls(file.trace, selected(file, args.window), args, {})

    def for_profile(self, profile: EngineProfile) -> TraceCurve:
        block_size = profile.effective_block_size
        key = (block_size, profile.max_model_len)
        if key not in self._curves:
            mapping = BlockMapping(
                self.trace.block_size,
                self.args.tokens_per_block or block_size,
                block_size,
                profile.max_model_len,
                self.args.output_scale,
            )
            requests, cuts = engine_requests(self.trace, mapping, self.chosen)
            pool = curve_requests(requests, mapping)
            self._curves[key] = TraceCurve(mapping, requests, pool, cuts, hit_rate_curve(pool, block_size))
        return self._curves[key]


def usable_blocks(profile: EngineProfile) -> int | None:
    tokens = profile.usable_kv_tokens()
    return None if tokens is None else tokens // profile.effective_block_size


def capacity_problem(traced: TraceCurve, profile: EngineProfile, users: int) -> str | None:
    """Why PROFILE's pool cannot hold the trace's running requests, with the arithmetic; else None."""
    pool = usable_blocks(profile)
    if pool is None:
        return None
    block = profile.effective_block_size
    largest = traced.curve.min_blocks
    if pool < largest:
        return (
            f"KV pool has {pool:,} usable blocks of {block}; the trace's largest request holds {largest:,} "
            "(prompt and output): it could never run"
        )
    running = min(users, profile.max_num_seqs or users)
    blocks = [r.total_blocks for r in traced.pool_requests]
    mean = sum(blocks) / len(blocks)
    needed = round(running * mean)
    if needed > pool:
        return (
            f"KV pool has {pool:,} usable blocks of {block}; {running} requests running hold {needed:,} "
            f"({running} x {mean:.1f}, the trace's mean request in blocks): they would be preempted"
        )
    return None


def same_but_budget(knobs: dict[str, object]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in knobs.items() if k not in BUDGET_KNOBS))


def within_noise(pools: Sequence[tuple[int, float]], noise: float) -> dict[int, tuple[int, float, float]]:
    """Of (pool blocks, predicted hit rate) pairs, the pools not worth measuring: pool -> (the smaller pool
    measured instead, its hit rate, this one's). A pool is kept when it beats the last kept one by at least
    NOISE; pools of equal size are all kept (they differ in how the size was set)."""
    skipped: dict[int, tuple[int, float, float]] = {}
    kept: tuple[int, float] | None = None
    for pool, rate in sorted(pools):
        if kept is not None and pool > kept[0] and rate - kept[1] < noise:
            skipped[pool] = (kept[0], kept[1], rate)
        else:
            kept = (pool, rate)
    return skipped


def noise_reason(smaller: int, smaller_rate: float, rate: float, pool: int, noise: float) -> str:
    return (
        f"the trace's curve predicts hit rate {rate:.1%} at {pool:,} usable blocks and {smaller_rate:.1%} at "
        f"{smaller:,}: within curve_noise {noise:g} of the smaller pool, which is measured instead "
        "(curve_noise: 0 measures every pool)"
    )


def write_curve_plot(
    folder: Path, spec: SweepSpec, measured: Sequence[tuple[int | None, float | None, str]]
) -> Path | None:
    """`curve.svg` in FOLDER: the base profile's curve for the spec's trace with each measured config's hit
    rate at its pool (MEASURED: pool tokens, hit rate, label). None when the workload is no hash-block
    trace."""
    curves = TraceCurves.of(spec)
    if curves is None:
        return None
    base = spec.base()
    traced = curves.for_profile(base)
    analysis = analyse(traced, pricing(base))
    block = base.effective_block_size
    points = [
        Measured(tokens // block - NULL_BLOCKS, rate, label)
        for tokens, rate, label in measured
        if tokens is not None and rate is not None
    ]
    path = folder / "curve.svg"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(path, curve_figure(traced.curve, analysis, points, "svg"))
    return path
