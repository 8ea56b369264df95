"""Make sense of a sweep's trials: rank configs over their repeats, say when the winner is within noise,
and explain in the engine's own figures why a load step missed the SLO.

Everything here is pure (records in, records or sentences out) so the report and `summary.json` share it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from kvtune.loadgen.results import LoadResult
from kvtune.sweep import ranking
from kvtune.sweep.records import (
    ConfigSummary,
    RunSummary,
    StepRecord,
    TrialRecord,
    TrialStatus,
    widest_ceiling,
)
from kvtune.sweep.spec import Slo, SweepSpec

# Two-sided 95% Student t quantiles by degrees of freedom; beyond 30 the normal 1.96 is close enough.
_T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

# One measurement per config: goodputs this close are not a real difference (run-to-run noise on a
# shared host is of this order, and the bisection itself only resolves the edge to a step).
SINGLE_RUN_TOLERANCE = 0.10

# A TTFT component "dominates" when it is at least this share of the engine's own mean TTFT.
DOMINANT_SHARE = 0.5

# Achieved below this share of the intended rate: the client, not the SLO, was the limit.
# A pool this full turns new requests away (vLLM keeps a little headroom).
KV_FULL = 0.9
KEEP_UP_SHARE = 0.95
# A step holding more than this many tokens per running stream carried prefill beside the decodes (a decode
# is one token per stream).
PREFILL_STEP_FACTOR = 2

# When no config ran, the one that "came closest" is the least non-done one, in this order of usefulness.
_STATUS_ORDER: tuple[TrialStatus, ...] = ("done", "failed", "infeasible", "pruned")


def t95(df: int) -> float:
    """Two-sided 95% t quantile for `df` degrees of freedom (df >= 1)."""
    return _T95[df - 1] if df <= len(_T95) else 1.96


def ci95(values: Sequence[float]) -> tuple[float, float] | None:
    """95% interval of the mean of `values` (Student t); None with fewer than two values."""
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half = t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    # A rate cannot be negative: the interval is cut at 0 rather than shown going below it.
    return max(0.0, mean - half), mean + half


def _config_status(trials: list[TrialRecord]) -> TrialStatus:
    """Done if any repeat was measured; else the most common status (first seen on a tie)."""
    statuses = [t.status for t in trials]
    if "done" in statuses:
        return "done"
    return max(dict.fromkeys(statuses), key=statuses.count)


def _config_reason(trials: list[TrialRecord], status: TrialStatus) -> str | None:
    if status != "done":
        return next((t.reason for t in trials if t.status == status and t.reason), None)
    failed = [t for t in trials if t.status != "done"]
    if not failed:
        return None
    # A done config can still have lost repeats; say so rather than silently averaging fewer runs.
    first = failed[0]
    return f"{len(failed)} of {len(trials)} repeats {first.status}: {first.reason or 'no reason recorded'}"


def summarize_config(trials: list[TrialRecord]) -> ConfigSummary:
    """One config over its repeats. Goodputs are those of measured repeats (a failed run measured nothing)."""
    status = _config_status(trials)
    measured = [t for t in trials if t.status == "done"] or trials
    goodputs = [t.goodput for t in measured]
    return ConfigSummary(
        config_id=trials[0].config_id,
        knobs=trials[0].knobs,
        goodputs=goodputs,
        mean_goodput=statistics.fmean(goodputs),
        ci95=ci95(goodputs),
        goodput_ceiling=widest_ceiling(measured),
        eligible=any(t.eligible for t in trials),
        status=status,
        reason=_config_reason(trials, status),
        steps=[step.verdict(t.repeat) for t in trials for step in t.steps],
    )


def group_trials(trials: list[TrialRecord]) -> dict[str, list[TrialRecord]]:
    """Trials by config id, configs in first-seen order (the list's: pruned records carry trial 0)."""
    groups: dict[str, list[TrialRecord]] = {}
    for trial in trials:
        groups.setdefault(trial.config_id, []).append(trial)
    return groups


def ranked(configs: list[ConfigSummary]) -> list[ConfigSummary]:
    """Configs that can win (eligible, goodput > 0), best first (kvtune.sweep.ranking says how)."""
    return ranking.rank(configs)


def _rate(config: ConfigSummary) -> str:
    return f"{config.config_id}: {config.mean_goodput:.2f} req/s"


def within_noise(configs: list[ConfigSummary]) -> str | None:
    """A plain warning when the best two configs cannot be told apart; None when the lead is real."""
    contenders = ranked(configs)
    if len(contenders) < 2:
        return None
    best, second = contenders[0], contenders[1]
    if best.ci95 is not None and second.ci95 is not None:
        if second.ci95[1] < best.ci95[0]:
            return None
        return (
            f"The best two configs ({_rate(best)}, 95% CI {best.ci95[0]:.2f}-{best.ci95[1]:.2f}; "
            f"{_rate(second)}, 95% CI {second.ci95[0]:.2f}-{second.ci95[1]:.2f}) are within noise of each "
            "other: their 95% intervals overlap. Prefer the cheaper one or add repeats."
        )
    if second.mean_goodput < best.mean_goodput * (1 - SINGLE_RUN_TOLERANCE):
        return None
    return (
        f"The best two configs ({_rate(best)}; {_rate(second)}) are within "
        f"{SINGLE_RUN_TOLERANCE:.0%} of each other and cannot be told apart by a single measurement each. "
        "Set `repeats: 3` in the sweep spec to measure the difference."
    )


def build_summary(
    spec: SweepSpec,
    trials: list[TrialRecord],
    *,
    finished: bool,
    stopped_because: str | None,
    elapsed_s: float,
    host_note: str | None,
) -> RunSummary:
    """summary.json for `trials`: every config over its repeats, the winner, and the noise warning."""
    configs = [summarize_config(group) for group in group_trials(trials).values()]
    contenders = ranked(configs)
    return RunSummary(
        name=spec.name,
        strategy=spec.strategy,
        slo=spec.slo.model_dump(),
        base_profile=str(spec.base_profile),
        host_note=host_note,
        configs=configs,
        best=contenders[0] if contenders else None,
        within_noise=within_noise(configs),
        comparisons=ranking.comparisons(ranking.standing(configs)),
        finished=finished,
        stopped_because=stopped_because,
        # Pruned configs never started an engine: recorded, but not run.
        trials_run=sum(t.status != "pruned" for t in trials),
        elapsed_s=elapsed_s,
    )


# --- Why a step missed -------------------------------------------------------------------------------


def _count(value: float) -> str:
    return f"{value:,.0f}"


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0%}"


def _kv_tokens(result: LoadResult) -> int | None:
    capacity = result.engine.kv_capacity or {}
    tokens = capacity.get("tokens")
    return int(tokens) if tokens else None


def _pool(result: LoadResult) -> str:
    tokens = _kv_tokens(result)
    return f"the KV pool ({_count(tokens)} tokens)" if tokens else "the KV pool"


def _touches_ttft(step: StepRecord) -> bool:
    """Queue and prefill explain first-token (and so end-to-end) misses, not inter-token ones."""
    return not step.misses or any(m.startswith(("TTFT", "E2E")) for m in step.misses)


def _budget(knobs: dict[str, Any] | None) -> str:
    """The config's step token budget as the report names it."""
    value = (knobs or {}).get("max_num_batched_tokens")
    return f"max_num_batched_tokens {value:,}" if value else "max_num_batched_tokens as the profile sets it"


def _split_prefills(step: StepRecord, knobs: dict[str, Any] | None) -> str:
    """When the step budget cut each request's prefill into several steps, that clause (else "")."""
    result, engine = step.result, step.result.engine
    largest, finished = engine.largest_step_tokens, result.requests
    if not largest or not finished:
        return ""
    uncached = max(0.0, engine.prompt_tokens - engine.prefix_cache_hits) / finished
    if uncached <= largest:
        return ""
    return (
        f"; each request's ~{_count(uncached)} uncached prompt tokens took at least "
        f"{math.ceil(uncached / largest)} steps of at most {_count(largest)} tokens ({_budget(knobs)}): a "
        "larger max_num_batched_tokens prefills in fewer steps"
    )


def _ttft_cause(step: StepRecord, knobs: dict[str, Any] | None = None) -> str | None:
    engine = step.result.engine
    parts = ttft_breakdown(step.result)
    queue, prefill = parts["queue"], parts["prefill"]
    total = engine.mean_engine_ttft_s or ((queue or 0.0) + (prefill or 0.0))
    if not total or not _touches_ttft(step):
        return None
    if queue is not None and queue / total >= DOMINANT_SHARE:
        return (
            f"first tokens waited {queue:.2f} s in the queue for a slot (of {total:.2f} s engine TTFT, "
            f"peak {_count(engine.peak_running)} running, {_count(engine.peak_waiting)} waiting): "
            "the batch limits (max_num_seqs / max_num_batched_tokens) held them back"
            + _split_prefills(step, knobs)
        )
    if prefill is not None and prefill / total >= DOMINANT_SHARE:
        return (
            f"prefill took {prefill:.2f} s per request (of {total:.2f} s engine TTFT): long prompts or "
            f"little prefix-cache reuse (hit rate {_pct(engine.hit_rate)})" + _split_prefills(step, knobs)
        )
    return None


def _itl_cause(step: StepRecord, knobs: dict[str, Any] | None = None) -> str | None:
    """Why streams paused between tokens: steps that carried prefill beside the decodes, or a wide batch."""
    if not any(m.startswith("ITL") for m in step.misses):
        return None
    engine = step.result.engine
    largest = engine.largest_step_tokens
    if largest is None:
        return None
    itl = f", engine mean ITL {engine.mean_engine_itl_s:.2f} s" if engine.mean_engine_itl_s else ""
    mean = f"mean {engine.mean_step_tokens:,.0f}, " if engine.mean_step_tokens else ""
    running = max(engine.peak_running, 1.0)
    if largest > PREFILL_STEP_FACTOR * running:
        return (
            f"streams paused while steps carried prefill: the largest engine steps held up to "
            f"{_count(largest)} tokens ({mean}{_budget(knobs)}) with at most {_count(running)} streams "
            f"decoding, and every stream's next token waits for its whole step{itl}: a smaller "
            "max_num_batched_tokens splits prefills into shorter steps"
        )
    return (
        f"streams paused in steps of decodes alone (largest up to {_count(largest)} tokens, peak "
        f"{_count(running)} running{itl}): the batch itself is slow on this host; a lower max_num_seqs "
        "shortens each step"
    )


def _throughput_cause(step: StepRecord) -> str | None:
    result = step.result
    intended = result.intended_rate or step.rate
    if result.unsent == 0 and result.achieved_rate >= intended * KEEP_UP_SHARE:
        return None
    unsent = f", {result.unsent:,} requests never sent" if result.unsent else ""
    return (
        f"the engine could not keep up: achieved {result.achieved_rate:.2f} req/s of {intended:.2f}{unsent} "
        f"(peak {_count(result.engine.peak_running)} running, {_count(result.engine.peak_waiting)} waiting)"
    )


def explain_miss(step: StepRecord, knobs: dict[str, Any] | None = None) -> str:
    """The likeliest engine-side reason a step missed the SLO, as one sentence with the figures; `knobs`
    (the config's settings) lets it name the value of the knob behind the figures."""
    result, engine = step.result, step.result.engine
    if engine.preemptions > 0:
        return (
            f"{_count(engine.preemptions)} preemptions: {_pool(result)} filled (peak usage "
            f"{engine.peak_kv_usage:.0%}), requests were evicted and re-prefilled."
        )
    # vLLM's "capacity" reason covers both a full KV pool and a full batch (max_num_seqs): tell them apart
    # by how full the pool got.
    waited = engine.peak_waiting_by_reason.get("capacity", 0.0)
    if waited > 0 and engine.peak_kv_usage >= KV_FULL:
        return (
            f"Up to {_count(waited)} requests waited for KV capacity: {_pool(result)} was the limit "
            f"(peak usage {engine.peak_kv_usage:.0%})."
        )
    causes = [c for c in (_ttft_cause(step, knobs), _itl_cause(step, knobs)) if c]
    cause = "; and ".join(causes) or _throughput_cause(step)
    if cause:
        return cause[0].upper() + cause[1:] + "."
    if waited > 0:
        return (
            f"Up to {_count(waited)} requests waited for a batch slot with {_pool(result)} only "
            f"{engine.peak_kv_usage:.0%} full (peak {_count(engine.peak_running)} running): "
            "max_num_seqs or the token budget, not KV, held them back."
        )
    if result.errors:
        example = f" (e.g. {result.error_examples[0]})" if result.error_examples else ""
        return f"{result.errors:,} of {result.requests + result.errors:,} requests failed{example}."
    return (
        "No engine-side cause stood out: no preemptions, peak KV usage "
        f"{engine.peak_kv_usage:.0%}, hit rate {_pct(engine.hit_rate)}, peak {_count(engine.peak_running)} "
        f"running and {_count(engine.peak_waiting)} waiting."
    )


def ttft_breakdown(result: LoadResult) -> dict[str, float | None]:
    """Where the engine's mean first-token time went: queue, prefill, and the rest (tokenizing, sampling...).

    Means of different histograms need not add up exactly, so `other` is floored at 0.
    """
    engine = result.engine
    queue, prefill, total = engine.mean_queue_s, engine.mean_prefill_s, engine.mean_engine_ttft_s
    other = None
    if total is not None and queue is not None and prefill is not None:
        other = max(0.0, total - queue - prefill)
    return {"queue": queue, "prefill": prefill, "other": other}


# --- Which config came closest when none met the SLO ---------------------------------------------------


def _overrun(result: LoadResult, slo: Slo) -> float:
    """How far a step is from the SLO: the worst measured/target ratio (<= 1 means it held)."""
    ratios = []
    for _name, metric, quantile, target in slo.targets():
        measured = getattr(getattr(result, metric), f"p{round(quantile * 100)}")
        ratios.append(math.inf if measured is None else measured / target)
    if result.error_rate > slo.max_error_rate:
        ratios.append(result.error_rate / slo.max_error_rate)
    return max(ratios, default=0.0)


def closest_miss(slo: Slo, trials: list[TrialRecord]) -> tuple[TrialRecord, StepRecord] | None:
    """The measured step nearest to meeting `slo` (smallest worst overrun), for "which came closest"."""
    steps = [(trial, step) for trial in trials for step in trial.steps if not step.passed]
    if not steps:
        return None
    return min(steps, key=lambda pair: (_overrun(pair[1].result, slo), -pair[1].rate))


def status_rank(status: TrialStatus) -> int:
    """Sort key: measured configs first, never-started ones last."""
    return _STATUS_ORDER.index(status)
