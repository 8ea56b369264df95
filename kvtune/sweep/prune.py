"""Rule out configs whose KV pool cannot hold the workload's concurrency, before any engine starts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from kvtune.loadgen.workload_args import workload_sizes
from kvtune.loadgen.workloads import shared_prefix_tokens
from kvtune.profile import EngineProfile
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.trace_curve import (
    TraceCurves,
    capacity_problem,
    noise_reason,
    same_but_budget,
    usable_blocks,
)
from kvtune.sweep.trace_curve import within_noise as curve_within_noise


@dataclass(frozen=True)
class Demand:
    """KV tokens a workload keeps resident: shared prefix once (with prefix caching), the rest per request."""

    shared_tokens: int
    per_request_tokens: int
    concurrency: int

    def shared_once(self, prefix_caching: bool, block: int = 1) -> int:
        """Only whole blocks of a shared prefix are cached and shared."""
        return (self.shared_tokens // block) * block if prefix_caching else 0

    def per_request(self, prefix_caching: bool, block: int = 1) -> int:
        whole = -(-(self.shared_tokens + self.per_request_tokens) // block) * block  # rounded up to blocks
        return whole - self.shared_once(prefix_caching, block)

    def tokens(self, prefix_caching: bool, block: int = 1) -> int:
        return self.shared_once(prefix_caching, block) + self.concurrency * self.per_request(
            prefix_caching, block
        )


def workload_demand(spec: SweepSpec) -> Demand | None:
    """Token demand of the spec's workload at its concurrency; None when sizes are not known up front.

    Sizes, defaults included, come from the workload's own flag definitions (workload_args).
    """
    workload = spec.workload
    if workload.name in ("replay", "trace"):
        return None  # prompt sizes are the user's (a trace's are judged by its curve: sweep/trace_curve.py)
    sizes = workload_sizes(workload.name, workload.args)
    output = workload.max_tokens
    if workload.name == "shared_prefix":
        system, user = sizes.count("system-tokens"), sizes.count("user-tokens")
        shared = shared_prefix_tokens(system, user, sizes.share("prefix-reuse"))
        return Demand(shared, system + user - shared + output, workload.users)
    if workload.name == "long_doc_qa":
        docs, doc = sizes.count("num-docs"), sizes.count("doc-tokens")
        return Demand(docs * doc, sizes.count("question-tokens") + output, workload.users)
    if workload.name == "multi_turn":
        turns, turn = sizes.count("turns"), sizes.count("turn-tokens")
        return Demand(0, turns * (turn + output), workload.users)
    return None


@dataclass(frozen=True)
class Candidate:
    knobs: dict[str, Any]
    profile: EngineProfile | None  # None: the knobs do not make a valid profile
    pruned: str | None = None  # why it cannot serve the workload, with the arithmetic
    unusable: bool = False  # no engine could start with it (not just KV pressure): always skipped

    def skipped(self, prune_by_kv: bool) -> bool:
        return self.pruned is not None and (prune_by_kv or self.unusable)


def candidates(spec: SweepSpec, base: EngineProfile, configs: list[dict[str, Any]]) -> list[Candidate]:
    """Each config as a profile, pruned when its KV pool cannot hold the workload's concurrency, or (a trace)
    when the trace's curve predicts a smaller pool hits as often."""
    demand = workload_demand(spec)
    curves = TraceCurves.of(spec)
    out = []
    for knobs in configs:
        try:
            configured = base.with_knobs(knobs)
        except ValidationError as exc:  # each value is usable, but not in this combination
            why = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            out.append(Candidate(knobs, None, f"not a valid profile: {why}", unusable=True))
            continue
        # As this host will run it: an fp8 pool that falls back to 16/32-bit holds fewer tokens.
        profile, note = configured.adapted_to_host()
        if note and (problem := profile.capacity_problem()):
            out.append(Candidate(knobs, profile, f"on this host ({note}): {problem}", unusable=True))
            continue
        capacity = profile.usable_kv_tokens()
        reason = None
        if demand is not None and capacity is not None:
            # The engine runs at most max_num_seqs at once; the rest wait without holding KV.
            running = replace(
                demand, concurrency=min(demand.concurrency, profile.max_num_seqs or demand.concurrency)
            )
            caching, block = profile.enable_prefix_caching, profile.effective_block_size
            needed = running.tokens(caching, block)
            if needed > capacity:
                reason = (
                    f"KV pool has {capacity:,} usable tokens; {running.concurrency} requests running need "
                    f"{needed:,} ({'shared prefix once + ' if caching else ''}{running.concurrency} x "
                    f"{running.per_request(caching, block):,} per request, in blocks of {block}): "
                    "they would be preempted"
                )
        if curves is not None and reason is None:
            reason = capacity_problem(curves.for_profile(profile), profile, spec.workload.users)
        out.append(Candidate(knobs, profile, reason))
    if curves is not None and spec.curve_noise > 0:
        out = _prune_by_curve(out, curves, spec.curve_noise)
    return out


def _prune_by_curve(found: list[Candidate], curves: TraceCurves, noise: float) -> list[Candidate]:
    """Among configs that differ only in their KV budget, the larger pools the curve puts within NOISE of a
    smaller one are pruned (sweep/trace_curve.py)."""
    groups: dict[tuple[tuple[str, str], ...], list[int]] = {}
    for index, candidate in enumerate(found):
        if candidate.profile is not None and candidate.pruned is None:
            groups.setdefault(same_but_budget(candidate.knobs), []).append(index)
    out = list(found)
    for members in groups.values():
        pools: dict[int, int] = {}  # member -> its pool's usable blocks
        predicted: dict[int, float] = {}  # pool -> its predicted hit rate
        for index in members:
            profile = found[index].profile
            pool = usable_blocks(profile) if profile is not None else None
            if profile is not None and pool is not None:
                pools[index] = pool
                predicted[pool] = curves.for_profile(profile).curve.hit_rate(pool)
        skipped = curve_within_noise(list(predicted.items()), noise)
        for index, pool in pools.items():
            if pool in skipped:
                smaller, smaller_rate, rate = skipped[pool]
                out[index] = replace(
                    found[index], pruned=noise_reason(smaller, smaller_rate, rate, pool, noise)
                )
    return out
