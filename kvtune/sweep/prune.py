"""Rule out configs whose KV pool cannot hold the workload's concurrency, before any engine starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtune.profile import EngineProfile
from kvtune.sweep.spec import SweepSpec, apply_knobs


@dataclass(frozen=True)
class Demand:
    """KV tokens a workload keeps resident: shared prefix once (with prefix caching), the rest per request."""

    shared_tokens: int
    per_request_tokens: int
    concurrency: int

    def per_request(self, prefix_caching: bool) -> int:
        return self.per_request_tokens + (0 if prefix_caching else self.shared_tokens)

    def tokens(self, prefix_caching: bool) -> int:
        shared_once = self.shared_tokens if prefix_caching else 0
        return shared_once + self.concurrency * self.per_request(prefix_caching)


def workload_demand(spec: SweepSpec) -> Demand | None:
    """Token demand of the spec's workload at its concurrency; None when sizes are not known up front."""
    workload, args = spec.workload, spec.workload.args
    output = workload.max_tokens
    if workload.name == "shared_prefix":
        system, user = int(args.get("system-tokens", 800)), int(args.get("user-tokens", 400))
        reuse = float(args.get("prefix-reuse", system / (system + user)))
        shared = round(reuse * (system + user))
        return Demand(shared, system + user - shared + output, workload.users)
    if workload.name == "long_doc_qa":
        docs, doc = int(args.get("num-docs", 2)), int(args.get("doc-tokens", 3000))
        return Demand(docs * doc, int(args.get("question-tokens", 32)) + output, workload.users)
    if workload.name == "multi_turn":
        turns, turn = int(args.get("turns", 4)), int(args.get("turn-tokens", 200))
        return Demand(0, turns * (turn + output), workload.users)
    return None  # replay: prompt sizes are the user's


@dataclass(frozen=True)
class Candidate:
    knobs: dict[str, Any]
    profile: EngineProfile
    pruned: str | None = None  # why it cannot serve the workload, with the arithmetic


def candidates(spec: SweepSpec, base: EngineProfile, configs: list[dict[str, Any]]) -> list[Candidate]:
    """Each config as a profile, pruned when its KV pool cannot hold the workload's concurrency."""
    demand = workload_demand(spec)
    out = []
    for knobs in configs:
        profile = apply_knobs(base, knobs)
        capacity = profile.kv_capacity_tokens()
        reason = None
        if demand is not None and capacity is not None:
            needed = demand.tokens(profile.enable_prefix_caching)
            if needed > capacity:
                caching = profile.enable_prefix_caching
                reason = (
                    f"KV pool holds {capacity:,} tokens; {demand.concurrency} requests in flight need "
                    f"{needed:,} ({'shared prefix once + ' if caching else ''}{demand.concurrency} x "
                    f"{demand.per_request(caching):,} per request): they would be preempted"
                )
        out.append(Candidate(knobs, profile, reason))
    return out
