"""Rule out configs whose KV pool cannot hold the workload's concurrency, before any engine starts."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from kvtune.loadgen.workload_args import workload_sizes
from kvtune.loadgen.workloads import shared_prefix_tokens
from kvtune.profile import EngineProfile
from kvtune.sweep.spec import SweepSpec


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
    if workload.name == "replay":
        return None  # prompt sizes are the user's
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
    """Each config as a profile, pruned when its KV pool cannot hold the workload's concurrency."""
    demand = workload_demand(spec)
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
        out.append(Candidate(knobs, profile, reason))
    return out
