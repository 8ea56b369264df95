"""Diagnose a vLLM engine from its own metrics over a window: the window's facts in, findings out.

Pure: the readers (`kvtune/commands/doctor.py`: the engine's /metrics, or a Prometheus server) gather the
facts (`kvtune.metrics_window`); this module judges them in the terms of the alert rules and shows the
arithmetic behind every piece of advice, so a user can check it and a rollout gate can read it as JSON.
The KV arithmetic (bytes per token, the blocks requests need) is `kvtune.kv_math`'s; for a tensor- or
pipeline-parallel engine its bytes are one GPU's, and the findings name that basis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvtune import kv_math, metrics
from kvtune.kv_math import KvBytes, KvNeed, label_int, mib
from kvtune.metrics_window import RESTARTED, WAITING_DEFERRED, Peaks, WindowFacts, from_snapshots
from kvtune.observability import alerts, residency, trace_advice
from kvtune.observability.findings import Finding as Finding
from kvtune.observability.findings import Level as Level
from kvtune.observability.findings import percent as _pct
from kvtune.observability.findings import pool_fix
from kvtune.observability.findings import seconds as _s
from kvtune.platform import NULL_BLOCKS
from kvtune.slo import DEFAULT_TTFT_P99_SLO_S

# The alert rules' thresholds (kvtune.observability.alerts), and the level a healthy long-running service
# keeps its hit rate above. Any preemption is a warning, and so is any request waiting for capacity.
HIT_RATE_HEALTHY = alerts.PREFIX_CACHE_HIT_RATE_HEALTHY
HIT_RATE_ALERT = alerts.PREFIX_CACHE_HIT_RATE_MIN
KV_USAGE_ALERT = alerts.KV_CACHE_USAGE_MAX
DEFAULT_TTFT_P99_S = DEFAULT_TTFT_P99_SLO_S

NO_TRAFFIC = "no requests in the window; hit rate and latency need traffic"

# ---- the diagnosis -------------------------------------------------------------------------------------


def per_gpu_basis(tp: int = 1, pp: int = 1) -> str:
    """How an engine's KV bytes are counted: "" on one GPU, else e.g. "per GPU (TP 4)". vLLM gives every
    rank the same num_gpu_blocks, each block of that rank's own layers and KV heads, and its
    kv_cache_memory_bytes is one GPU's budget: bytes are per GPU, tokens and blocks the engine's."""
    sizes = [f"{name} {size}" for name, size in (("TP", tp), ("PP", pp)) if size > 1]
    return f"per GPU ({' x '.join(sizes)})" if sizes else ""


def kv_need(facts: WindowFacts, capacity: metrics.KvCapacity) -> KvNeed | None:
    """Sized by the window's finished requests, else by the lifetime means; None when none finished."""
    prompt, output, source = facts.mean_prompt_tokens, facts.mean_output_tokens, "the window's means"
    if prompt is None or output is None:
        prompt, output = facts.lifetime_mean_prompt_tokens, facts.lifetime_mean_output_tokens
        why = facts.unknown.get("mean_prompt_tokens") or facts.unknown.get("mean_output_tokens")
        source = (
            f"lifetime means: the window's are unknown ({why})"
            if why
            else ("lifetime means: no request finished in the window")
        )
    if prompt is None or output is None or capacity.block_size <= 0:
        return None
    return KvNeed(
        running=round(facts.peaks.running),
        waiting=round(facts.peaks.waiting_for_capacity),
        prompt_tokens=prompt,
        output_tokens=output,
        block_size=capacity.block_size,
        source=source,
    )


def _count(value: float, noun: str) -> str:
    return f"{value:,.0f} {noun}{'' if round(value) == 1 else 's'}"


def kv_bound(facts: WindowFacts) -> bool:
    """The KV pool is what limits the engine: it preempted, or it ran nearly full."""
    return facts.preemptions > 0 or facts.peaks.kv_usage > KV_USAGE_ALERT


def _hit_rate(facts: WindowFacts, capacity: metrics.KvCapacity | None) -> Finding | None:
    lifetime = metrics.hit_rate(facts.lifetime_hits, facts.lifetime_queries)
    lifetime_text = (
        ""
        if lifetime is None
        else f"; lifetime {_pct(lifetime)} ({facts.lifetime_hits:,.0f} / {facts.lifetime_queries:,.0f})"
    )
    rate = metrics.hit_rate(facts.hits, facts.queries)
    if rate is None:
        if capacity is not None and not capacity.prefix_caching and facts.traffic:
            return Finding(
                "hit_rate",
                "ok",
                "prefix caching is off (enable_prefix_caching False): every prompt is prefilled in full; "
                "turn it on when prompts share a system prompt or document",
            )
        if facts.traffic:
            return Finding(
                "hit_rate", "ok", "no prompt tokens were looked up in the prefix cache in the window"
            )
        return None
    arithmetic = (
        f"{facts.hits:,.0f} hit / {facts.queries:,.0f} queried prompt tokens = {_pct(rate)}{lifetime_text}"
    )
    if rate >= HIT_RATE_HEALTHY:
        return Finding(
            "hit_rate",
            "ok",
            f"prefix-cache hit rate {_pct(rate)}: healthy (at least {HIT_RATE_HEALTHY:.0%})",
            arithmetic,
        )
    if rate >= HIT_RATE_ALERT:
        text = (
            f"prefix-cache hit rate {_pct(rate)}: below the healthy {HIT_RATE_HEALTHY:.0%}, above the "
            f"{HIT_RATE_ALERT:.0%} alert"
        )
        return Finding("hit_rate", "ok", text, arithmetic)
    why = (
        "the pool is full, so shared prefixes are evicted before they are reused (see kv_size)"
        if kv_bound(facts)
        else "shared prefixes are evicted before they are reused (raise the KV budget or use fp8), or the "
        "prompts share little (no setting reaches the target then: silence the alert for this engine)"
    )
    return Finding(
        "hit_rate",
        "warn",
        f"prefix-cache hit rate {_pct(rate)}: below the {HIT_RATE_ALERT:.0%} alert; {why}",
        arithmetic,
    )


def _preemptions(facts: WindowFacts) -> Finding | None:
    if not facts.traffic and not facts.preemptions:
        return None
    per_min = facts.preemptions / facts.seconds * 60 if facts.seconds > 0 else 0.0
    arithmetic = f"{facts.preemptions:,.0f} / {facts.seconds:.0f} s x 60 = {per_min:.1f} per minute"
    if facts.preemptions > 0:
        text = (
            f"{_count(facts.preemptions, 'preemption')} in {facts.seconds:.0f} s ({per_min:.1f}/min): the KV "
            "pool ran out and evicted running requests, which are prefilled again"
        )
        return Finding("preemptions", "warn", text, arithmetic)
    return Finding("preemptions", "ok", "no preemptions", arithmetic)


def _kv_usage(facts: WindowFacts) -> Finding:
    peak = facts.peaks.kv_usage
    if peak > KV_USAGE_ALERT:
        return Finding(
            "kv_usage",
            "warn",
            f"peak KV usage {peak:.0%}: above the {KV_USAGE_ALERT:.0%} alert, the pool is about to preempt",
        )
    return Finding("kv_usage", "ok", f"peak KV usage {peak:.0%}")


def _waiting(facts: WindowFacts, capacity: metrics.KvCapacity | None, need: KvNeed | None) -> Finding:
    peaks = facts.peaks
    waiting = peaks.waiting_for_capacity
    deferred = peaks.waiting_by_reason.get(WAITING_DEFERRED, 0.0)
    deferred_text = f"; {deferred:.0f} deferred (LoRA budget, KV transfer)" if deferred else ""
    if waiting <= 0:
        return Finding("waiting", "ok", f"no request waited for capacity{deferred_text}")
    text = f"up to {_count(waiting, 'request')} waited for capacity{deferred_text}"
    if kv_bound(facts):
        return Finding("waiting", "warn", f"{text}: the KV pool had no room (see kv_size)")
    arithmetic = ""
    if capacity is not None and need is not None:
        usable = capacity.num_blocks - NULL_BLOCKS
        room = usable // need.blocks_per_request
        arithmetic = (
            f"the pool has room for {room:,} requests of ~{need.tokens_per_request:,} tokens "
            f"({usable:,} usable blocks / {need.blocks_per_request:,} blocks of {need.block_size} each)"
        )
    return Finding(
        "waiting",
        "warn",
        f"{text} while KV usage peaked at {peaks.kv_usage:.0%}: the batch limits held them, not the KV pool; "
        f"running peaked at {peaks.running:.0f}: raise max_num_seqs above {peaks.running:.0f}, or "
        "max_num_batched_tokens when long prompts fill each step",
        arithmetic,
    )


def _kv_sizing(
    facts: WindowFacts,
    capacity: metrics.KvCapacity,
    cache: dict[str, str],
    kv: KvBytes,
    need: KvNeed | None,
    basis: str = "",
) -> Finding:
    """How big the pool must be for the peak's requests, in tokens and (when known) bytes (per GPU when
    `basis` says so)."""
    if need is None or need.requests == 0:
        missing = "no request has finished yet" if need is None else "no samples saw a running request"
        return Finding(
            "kv_size",
            "warn",
            f"the KV pool is the limit, but {missing} to size it by: rerun the doctor over a window with "
            "traffic",
        )
    pool_tokens = capacity.num_blocks * capacity.block_size
    usable = capacity.num_blocks - NULL_BLOCKS
    head = (
        f"{need.running} running + {need.waiting} waiting requests of ~{need.tokens_per_request:,} tokens "
        f"need {need.tokens:,} KV tokens; the pool holds {pool_tokens:,}"
    )
    lines = [
        f"~{need.prompt_tokens:,.0f} prompt + {need.output_tokens:,.0f} output tokens per request "
        f"({need.source}) = {need.blocks_per_request:,} blocks of {need.block_size}; "
        f"{need.requests} x {need.blocks_per_request:,} = {need.blocks:,} blocks = {need.tokens:,} tokens",
        f"pool: {capacity.num_blocks:,} blocks x {capacity.block_size} = {pool_tokens:,} tokens, "
        f"{usable:,} usable ({NULL_BLOCKS} is vLLM's null block)",
    ]
    fits = need.blocks <= usable
    target_blocks = need.blocks + NULL_BLOCKS if not fits else math.ceil(capacity.num_blocks * 1.25)
    if fits:
        head += ": at the mean request size they fit, so longer requests fill it; give it headroom"
        lines.append(f"headroom: 1.25 x {capacity.num_blocks:,} blocks = {target_blocks:,} blocks")
    on = f" {basis}" if basis else ""
    pool_bytes = kv_math.pool_bytes(capacity, cache, kv)
    fix, fix_lines = pool_fix(capacity, cache, kv, target_blocks, basis)
    fixes = [fix]
    lines += fix_lines
    if not kv_math.is_fp8(capacity.cache_dtype):
        if kv.fp8_per_token and pool_bytes:
            fp8_tokens = kv_math.kv_tokens(pool_bytes, kv.fp8_per_token, capacity.block_size)
            enough = (
                "enough" if fp8_tokens - NULL_BLOCKS * capacity.block_size >= need.tokens else "not enough"
            )
            fixes.append("use kv_cache_dtype fp8")
            lines.append(
                f"fp8: {kv.fp8_per_token:,} bytes/token{on}, the same {mib(pool_bytes)} holds {fp8_tokens:,} "
                f"tokens ({enough}; on CPU it needs AVX-512 or AMX)"
            )
        else:
            fixes.append("use kv_cache_dtype fp8 (1 byte per element: at least twice the tokens)")
    if not fits and need.blocks_per_request <= usable:
        seqs = usable // need.blocks_per_request
        fixes.append(f"cap max_num_seqs at {seqs}")
        lines.append(
            f"max_num_seqs: {usable:,} usable blocks / {need.blocks_per_request:,} each = {seqs} requests"
        )
    either = fixes[0] if len(fixes) == 1 else f"{', '.join(fixes[:-1])} or {fixes[-1]}"
    return Finding("kv_size", "warn", f"{head}: {either}", "\n".join(lines))


def _ttft(facts: WindowFacts, ttft_p99_s: float) -> Finding | None:
    if facts.mean_ttft_s is None:
        return None
    mean = facts.mean_ttft_s
    parts = []
    queue, prefill = facts.mean_queue_s, facts.mean_prefill_s
    if queue is not None and prefill is not None:
        other = mean - queue - prefill
        parts.append(
            f"mean TTFT {_s(mean)} = queue {_s(queue)} + prefill {_s(prefill)}"
            + (f" + {_s(other)} other (tokenizing, scheduling)" if other > 0.005 else "")
        )
    else:
        parts.append(f"mean TTFT {_s(mean)}")
    p99 = facts.p99_ttft_s
    if p99 is not None:
        parts.append(f"p99 {_s(p99)} (from the histogram's buckets)")
    arithmetic = "; ".join(parts) + f"; {facts.first_tokens:,.0f} requests got a first token"
    where = ""
    if queue is not None and prefill is not None and mean > 0:
        if queue >= prefill:
            where = f"queueing is {queue / mean:.0%} of it: requests wait for room (see waiting and kv_usage)"
        else:
            where = (
                f"prefill is {prefill / mean:.0%} of it: long or uncached prompts; prefix caching and a "
                "larger max_num_batched_tokens shorten it"
            )
    judged = p99 if p99 is not None else mean
    name = "p99" if p99 is not None else "mean"
    if judged > ttft_p99_s:
        text = f"TTFT {name} {_s(judged)}: above the {_s(ttft_p99_s)} target" + (
            f"; {where}" if where else ""
        )
        return Finding("ttft", "warn", text, arithmetic)
    return Finding("ttft", "ok", f"TTFT {name} {_s(judged)}: within the {_s(ttft_p99_s)} target", arithmetic)


def _load(facts: WindowFacts) -> Finding:
    peaks = facts.peaks
    reasons = ", ".join(f"{reason} {value:.0f}" for reason, value in sorted(peaks.waiting_by_reason.items()))
    text = (
        f"running {facts.running:.0f}, waiting {facts.waiting:.0f} at the end; peaks: running "
        f"{peaks.running:.0f}, waiting {peaks.waiting:.0f}" + (f" ({reasons})" if reasons else "")
    )
    lines = []
    if facts.finished and facts.seconds > 0:
        lines.append(
            f"{facts.finished:,.0f} requests finished in {facts.seconds:.0f} s = "
            f"{facts.finished / facts.seconds:.2f}/s"
        )
    if facts.mean_prompt_tokens is not None and facts.mean_output_tokens is not None:
        lines.append(
            f"mean per request: {facts.mean_prompt_tokens:,.0f} prompt + {facts.mean_output_tokens:,.0f} "
            "output tokens"
        )
    return Finding("load", "ok", text, "\n".join(lines))


def _pool(
    capacity: metrics.KvCapacity | None,
    cache: dict[str, str],
    kv: KvBytes,
    problems: list[str],
    basis: str = "",
) -> Finding:
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return Finding("kv_pool", "warn", f"the KV pool is unknown: {problems[0]}{more}")
    if capacity is None:
        return Finding(
            "kv_pool", "ok", f"the engine reports no {metrics.CACHE_CONFIG_INFO}: its KV pool size is unknown"
        )
    text = (
        f"KV pool {capacity.num_blocks * capacity.block_size:,} tokens ({capacity.num_blocks:,} blocks of "
        f"{capacity.block_size}), cache_dtype {capacity.cache_dtype}, prefix caching "
        f"{'on' if capacity.prefix_caching else 'off'}"
    )
    tokens = capacity.num_blocks * capacity.block_size
    explicit = label_int(cache, "kv_cache_memory_bytes")
    if kv.per_token is not None:
        arithmetic = f"{kv.how}; x {tokens:,} tokens = {kv_math.format_bytes(tokens * kv.per_token)}"
        if explicit:
            arithmetic += f" (kv_cache_memory_bytes {explicit:,} = {kv_math.format_bytes(explicit)})"
        if basis:
            pool_bytes = kv_math.pool_bytes(capacity, cache, kv) or tokens * kv.per_token
            text += f"; {basis}: {kv.per_token:,} bytes/token, {kv_math.format_bytes(pool_bytes)}"
            arithmetic = f"{basis}: {arithmetic}"
    else:
        arithmetic = f"bytes per token unknown: {kv.how}"
    return Finding("kv_pool", "ok", text, arithmetic)


# The facts each check judges: a check with one of them unknown gives no verdict rather than a wrong one.
CHECK_NEEDS: dict[str, tuple[str, ...]] = {
    "hit_rate": ("hits", "queries"),
    "preemptions": ("preemptions",),
    "kv_usage": ("peaks.kv_usage",),
    "waiting": ("peaks.waiting", "peaks.waiting_by_reason", "peaks.running", "peaks.kv_usage"),
    "kv_size": ("peaks.waiting", "peaks.waiting_by_reason", "peaks.running", "peaks.kv_usage"),
    "ttft": ("mean_ttft_s", "p99_ttft_s", "mean_queue_s", "mean_prefill_s", "first_tokens"),
    "load": ("running", "waiting", "peaks.running", "peaks.waiting"),
    residency.CHECK: (
        "evicted_blocks",
        "reuse_gaps",
        "idle_before_evict_s",
        "reuse_gap_s",
        "reuse_gap_median_s",
        "block_lifetime_median_s",
    ),
}


def _restart(facts: WindowFacts) -> Finding:
    return Finding(
        "restart",
        "warn",
        f"{RESTARTED} ({facts.reset_detail}): its counters started again from zero, so the window's hit "
        "rate, preemptions and TTFT are unknown; rerun the doctor over a window without a restart",
    )


def _unjudged(blind: dict[str, list[str]]) -> Finding:
    reasons = list(dict.fromkeys(reason for reasons in blind.values() for reason in reasons))
    more = f" (and {len(reasons) - 3} more)" if len(reasons) > 3 else ""
    return Finding(
        "unreadable",
        "warn",
        f"no verdict on {', '.join(blind)}: samples they need were skipped ({'; '.join(reasons[:3])}{more})",
    )


def diagnose(
    facts: WindowFacts,
    capacity: metrics.KvCapacity | None,
    cache: dict[str, str],
    kv: KvBytes,
    ttft_p99_s: float = DEFAULT_TTFT_P99_S,
    pool_problems: list[str] | None = None,
    basis: str = "",
    curve: Callable[[WindowFacts], Finding | None] | None = None,
) -> list[Finding]:
    """Every finding, warnings first; `cache` is the labels of `vllm:cache_config_info` (without those
    `pool_problems` say hold no number). Facts the window could not know are judged as absent. `basis`
    (`per_gpu_basis`) names what `kv`'s bytes count for a parallel engine. CURVE judges the pool by a trace's
    hit-rate curve (`trace_advice`); the residency check then leaves the pool's size to it. Facts that cannot
    be one engine's (`WindowFacts.impossible`) are not judged at all: that is the one finding."""
    if facts.impossible:
        return [Finding("impossible", "warn", facts.impossible)]
    facts = facts.known()
    findings: list[Finding] = []
    if facts.counters_reset:
        findings.append(_restart(facts))
    elif not facts.traffic:
        lifetime = metrics.hit_rate(facts.lifetime_hits, facts.lifetime_queries)
        lifetime_text = "" if lifetime is None else f"lifetime prefix-cache hit rate {_pct(lifetime)}"
        findings.append(Finding("traffic", "ok", NO_TRAFFIC, lifetime_text))
    need = kv_need(facts, capacity) if capacity is not None else None
    checks: dict[str, Callable[[], Finding | None]] = {
        "hit_rate": lambda: _hit_rate(facts, capacity),
        "preemptions": lambda: _preemptions(facts),
        "kv_usage": lambda: _kv_usage(facts),
        "waiting": lambda: _waiting(facts, capacity, need),
        "kv_size": lambda: (
            _kv_sizing(facts, capacity, cache, kv, need, basis)
            if capacity is not None and kv_bound(facts)
            else None
        ),
        "ttft": lambda: _ttft(facts, ttft_p99_s),
        "load": lambda: _load(facts),
        residency.CHECK: lambda: residency.judge(
            facts, capacity, cache, kv, basis, sized_elsewhere=trace_advice.SIZED_BY_CURVE if curve else None
        ),
    }
    blind: dict[str, list[str]] = {}
    for check, judge in checks.items():
        reasons = [facts.unknown[fact] for fact in CHECK_NEEDS[check] if fact in facts.unknown]
        if not reasons:
            findings += [finding for finding in [judge()] if finding is not None]
        elif any(reason != RESTARTED for reason in reasons):  # a restart is said once, above
            blind[check] = [reason for reason in reasons if reason != RESTARTED]
    if curve is not None:
        findings += [finding for finding in [curve(facts)] if finding is not None]
    if blind:
        findings.append(_unjudged(blind))
    findings.append(_pool(capacity, cache, kv, pool_problems or [], basis))
    return sorted(findings, key=lambda finding: finding.level != "warn")


def pool_of(
    samples: list[metrics.Sample],
) -> tuple[metrics.KvCapacity | None, dict[str, str], list[str]]:
    """The engine's KV pool from `vllm:cache_config_info` (None when absent or unreadable), its labels
    without those that should hold a count and do not, and why each of those was dropped."""
    cache, problems = metrics.readable_cache_config(metrics.cache_config(samples))
    try:
        capacity = metrics.KvCapacity.from_labels(cache)
    except ValueError as exc:  # a block size of 0
        return None, cache, [*problems, str(exc)]
    return (None if problems else capacity), cache, problems


def capacity_of(samples: list[metrics.Sample]) -> metrics.KvCapacity | None:
    """The engine's KV pool from `vllm:cache_config_info`; None when absent or unreadable."""
    return pool_of(samples)[0]


def diagnose_snapshots(
    before: list[metrics.Sample],
    after: list[metrics.Sample],
    peaks: Peaks,
    seconds: float,
    kv: KvBytes,
    ttft_p99_s: float = DEFAULT_TTFT_P99_S,
    basis: str = "",
) -> list[Finding]:
    """Two scrapes of one engine, the gauge peaks between them and its KV bytes per token -> findings."""
    facts = from_snapshots(before, after, peaks, seconds)
    capacity, cache, problems = pool_of(after)
    return diagnose(facts, capacity, cache, kv, ttft_p99_s, problems, basis)


def healthy(findings: list[Finding]) -> bool:
    return all(finding.level == "ok" for finding in findings)


# Window facts the doctor does not judge (the load runner's): its JSON, which rollout gates read, keeps
# the fields it has always had.
_NOT_REPORTED = frozenset({"mean_itl_s", "mean_step_tokens", "largest_step_tokens"})


def report(
    source: str, facts: WindowFacts, capacity: metrics.KvCapacity | None, findings: list[Finding]
) -> dict[str, Any]:
    """The diagnosis as strict JSON data, for rollout gates: an unknown fact, or any figure that is not a
    finite number, is null, and `facts.unknown` says why (strict parsers refuse NaN and Infinity)."""
    facts = facts.known()
    data = {k: v for k, v in asdict(facts).items() if k not in _NOT_REPORTED} | {"traffic": facts.traffic}
    unknown = {fact: why for fact, why in facts.unknown.items() if fact not in _NOT_REPORTED}
    for fact in list(unknown):
        section, _, name = fact.rpartition(".")
        holder = data[section] if section else data
        if name in holder:
            holder[name] = None
    data = _finite(data, "", unknown)
    data["unknown"] = unknown
    return {
        "source": source,
        "healthy": healthy(findings),
        "window_s": _finite(facts.seconds, "window_s", unknown),
        "findings": [asdict(finding) for finding in findings],
        "facts": data,
        "kv_capacity": None if capacity is None else asdict(capacity),
    }


def _finite(value: Any, path: str, unknown: dict[str, str]) -> Any:
    """`value` with every float that is not finite replaced by None, and why recorded under its path."""
    if isinstance(value, float) and not math.isfinite(value):
        unknown.setdefault(path, f"{value} is not a finite number")
        return None
    if isinstance(value, dict):
        return {
            key: _finite(item, f"{path}.{key}" if path else str(key), unknown) for key, item in value.items()
        }
    if isinstance(value, list):
        return [_finite(item, f"{path}[{index}]", unknown) for index, item in enumerate(value)]
    return value
