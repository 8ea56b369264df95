"""Typed results of one load run: client latencies from per-request samples, engine metric deltas."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from kvtune import metrics


class Percentiles(BaseModel):
    """Seconds; percentiles over every sample of the measured window."""

    count: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        if not values:
            return cls(count=0)
        p50, p90, p95, p99 = (float(v) for v in np.percentile(values, [50, 90, 95, 99]))
        return cls(count=len(values), mean=float(np.mean(values)), p50=p50, p90=p90, p95=p95, p99=p99)


class LatencySamples(BaseModel):
    """Every measured latency of a window, sorted, in seconds (rounded to 0.1 ms): what confidence bounds on
    a quantile are computed from. ITL holds every gap of every request."""

    ttft: list[float] = Field(default_factory=list)
    itl: list[float] = Field(default_factory=list)
    e2e: list[float] = Field(default_factory=list)

    @classmethod
    def of(cls, ttft: list[float], itl: list[float], e2e: list[float]) -> LatencySamples:
        def kept(values: list[float]) -> list[float]:
            return sorted(round(value, 4) for value in values)

        return cls(ttft=kept(ttft), itl=kept(itl), e2e=kept(e2e))

    def merged(self, other: LatencySamples) -> LatencySamples:
        return LatencySamples.of(self.ttft + other.ttft, self.itl + other.itl, self.e2e + other.e2e)


class EngineDeltas(BaseModel):
    """What the engine itself saw over the measured window (counter deltas, gauge peaks)."""

    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    hit_rate: float | None = Field(None, description="hits / queries over the window, in prompt tokens")
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    peak_kv_usage: float = 0.0
    peak_running: float = 0.0
    peak_waiting: float = 0.0
    peak_waiting_by_reason: dict[str, float] = Field(default_factory=dict)
    kv_capacity: dict[str, Any] | None = None
    mean_queue_s: float | None = Field(None, description="engine: arrival to first scheduled, per request")
    mean_prefill_s: float | None = Field(None, description="engine: first scheduled to first token")
    mean_engine_ttft_s: float | None = Field(None, description="engine: arrival to first token")
    mean_engine_itl_s: float | None = Field(None, description="engine: gap between a stream's tokens")
    mean_step_tokens: float | None = Field(None, description="engine: tokens per scheduler step, mean")
    largest_step_tokens: float | None = Field(
        None, description="engine: the largest step held at most this many tokens (its histogram bucket)"
    )
    counters_reset: bool = Field(
        False,
        description="the engine's counters went down in the window (it restarted): deltas count from then",
    )


COUNTERS = {
    "prefix_cache_queries": metrics.PREFIX_CACHE_QUERIES,
    "prefix_cache_hits": metrics.PREFIX_CACHE_HITS,
    "preemptions": metrics.PREEMPTIONS,
    "prompt_tokens": metrics.PROMPT_TOKENS,
    "generation_tokens": metrics.GENERATION_TOKENS,
}


# Histogram means over the window (delta of _sum / delta of _count): where a first token's time went.
HISTOGRAM_MEANS = {
    "mean_queue_s": metrics.QUEUE_TIME_SECONDS,
    "mean_prefill_s": metrics.PREFILL_TIME_SECONDS,
    "mean_engine_ttft_s": metrics.TTFT_SECONDS,
    "mean_engine_itl_s": metrics.ITL_SECONDS,
    "mean_step_tokens": metrics.ITERATION_TOKENS,
}


# Every engine metric a result is computed from: a value of one that is not a finite number makes it nonsense.
READ_METRICS = frozenset(
    {
        *COUNTERS.values(),
        *(f"{name}_{part}" for name in HISTOGRAM_MEANS.values() for part in ("sum", "count")),
        metrics.KV_CACHE_USAGE,
        metrics.REQUESTS_RUNNING,
        metrics.REQUESTS_WAITING,
        metrics.REQUESTS_WAITING_BY_REASON,
    }
)


def _histogram_mean(before: list[metrics.Sample], after: list[metrics.Sample], name: str) -> float | None:
    count = metrics.total(after, f"{name}_count") - metrics.total(before, f"{name}_count")
    if count <= 0:
        return None
    return (metrics.total(after, f"{name}_sum") - metrics.total(before, f"{name}_sum")) / count


def _histogram_top(before: list[metrics.Sample], after: list[metrics.Sample], name: str) -> float | None:
    """The upper edge of the highest bucket that gained an observation in the window: no observation was
    larger (None when nothing was observed, or only above the last finite edge)."""
    gained: dict[float, float] = {}
    for samples, sign in ((after, 1.0), (before, -1.0)):
        for sample in samples:
            if sample.name == f"{name}_bucket":
                try:
                    edge = float(sample.labels.get("le", "nan"))
                except ValueError:  # not a bucket edge: nothing to learn from it
                    continue
                gained[edge] = gained.get(edge, 0.0) + sign * sample.value
    count = metrics.total(after, f"{name}_count") - metrics.total(before, f"{name}_count")
    if count <= 0:
        return None
    return min((edge for edge, n in gained.items() if n >= count and math.isfinite(edge)), default=None)


class GaugePeaks:
    """Running maxima of the engine's gauges, fed with every scrape during the window."""

    def __init__(self) -> None:
        self.kv_usage = self.running = self.waiting = 0.0
        self.by_reason: dict[str, float] = {}

    def update(self, samples: list[metrics.Sample]) -> None:
        self.kv_usage = max(self.kv_usage, metrics.total(samples, metrics.KV_CACHE_USAGE))
        self.running = max(self.running, metrics.total(samples, metrics.REQUESTS_RUNNING))
        self.waiting = max(self.waiting, metrics.total(samples, metrics.REQUESTS_WAITING))
        for sample in samples:
            if sample.name == metrics.REQUESTS_WAITING_BY_REASON:
                reason = sample.labels.get("reason", "?")
                self.by_reason[reason] = max(self.by_reason.get(reason, 0.0), sample.value)


def _capacity(samples: list[metrics.Sample]) -> metrics.KvCapacity | None:
    try:
        return metrics.KvCapacity.from_samples(samples)
    except ValueError:  # pool labels that are no numbers ("inf"): the window's other figures still stand
        return None


def counter_increase(before: float, after: float) -> float:
    """How much a counter grew; one that went down was reset (its process restarted) and counts from zero
    since, as Prometheus's increase() takes it."""
    return after - before if after >= before else after


def _counters_went_down(before: list[metrics.Sample], after: list[metrics.Sample]) -> bool:
    names = [*COUNTERS.values(), *(f"{name}_count" for name in HISTOGRAM_MEANS.values())]
    return any(metrics.total(after, name) < metrics.total(before, name) for name in names)


def engine_deltas(
    before: list[metrics.Sample], after: list[metrics.Sample], peaks: GaugePeaks
) -> EngineDeltas:
    reset = _counters_went_down(before, after)
    if reset:  # an engine restarts all its counters at once: every delta counts from zero since
        before = []
    values = {
        field: metrics.total(after, name) - metrics.total(before, name) for field, name in COUNTERS.items()
    }
    capacity = _capacity(after)
    return EngineDeltas(
        **values,
        hit_rate=metrics.hit_rate(values["prefix_cache_hits"], values["prefix_cache_queries"]),
        peak_kv_usage=peaks.kv_usage,
        peak_running=peaks.running,
        peak_waiting=peaks.waiting,
        peak_waiting_by_reason=peaks.by_reason,
        kv_capacity=capacity.__dict__ if capacity else None,
        **{field: _histogram_mean(before, after, name) for field, name in HISTOGRAM_MEANS.items()},
        largest_step_tokens=_histogram_top(before, after, metrics.ITERATION_TOKENS),
        counters_reset=reset,
    )


class LoadResult(BaseModel):
    """One load run, warm-up excluded: what users felt and what the engine did."""

    workload: str
    arrival: str
    users: int
    window_s: float
    requests: int
    errors: int
    error_examples: list[str] = Field(
        default_factory=list,
        description="distinct reasons requests of the window failed; when the window holds no request at "
        "all, those of the requests sent before it (what kept its users busy)",
    )
    ttft: Percentiles
    ttft_p99_over_time: list[float | None] = Field(
        default_factory=list, description="TTFT p99 of each quarter of the window: a growing queue shows here"
    )
    ttft_trend: float | None = Field(
        None, description="slope of TTFT over the run (s per s): ~0 when steady, > 0 when a queue builds"
    )
    itl: Percentiles
    e2e: Percentiles
    request_rate: float = Field(description="requests completed per second in the window")
    output_token_rate: float = Field(description="output tokens per second in the window")
    intended_rate: float | None = Field(None, description="open loop: the arrival rate asked for")
    achieved_rate: float = Field(description="requests actually sent per second in the window")
    unsent: int = Field(0, description="open loop: requests due in the window that no free client slot sent")
    target_reuse: float | None = Field(None, description="designed share of prompt tokens a cache can reuse")
    engine: EngineDeltas
    samples: LatencySamples | None = Field(None, description="every latency measured, for confidence bounds")
    windows: int = Field(1, ge=1, description="measured windows at this rate merged into this result")

    @property
    def error_rate(self) -> float:
        """Share of the window's requests that failed or were never sent; 1.0 when none were due.

        Unsent requests count as errors: users whose requests a saturated client never sent were not
        served. A window with no requests at all measured nothing, so it cannot pass for error-free.
        """
        due = self.requests + self.errors + self.unsent
        return (self.errors + self.unsent) / due if due else 1.0


def trend(times: list[float], values: list[float]) -> float | None:
    """Least-squares slope of values over times; None with fewer than three points."""
    if len(values) < 3 or max(times) == min(times):
        return None
    slope, _intercept = np.polyfit(times, values, 1)
    return float(slope)


def merge_results(first: LoadResult, later: LoadResult) -> LoadResult:
    """Two windows at the same rate as one longer measurement: requests and samples pooled, rates
    weighted by window length, engine counters summed and gauge peaks kept at their maximum."""
    samples = (first.samples or LatencySamples()).merged(later.samples or LatencySamples())
    window = first.window_s + later.window_s

    def weighted(a: float, b: float) -> float:
        return (a * first.window_s + b * later.window_s) / window

    engine = merge_engine_deltas(first.engine, later.engine, first.requests, later.requests)
    return first.model_copy(
        update={
            "window_s": window,
            "requests": first.requests + later.requests,
            "errors": first.errors + later.errors,
            "error_examples": sorted({*first.error_examples, *later.error_examples})[:5],
            "ttft": Percentiles.of(samples.ttft),
            "itl": Percentiles.of(samples.itl),
            "e2e": Percentiles.of(samples.e2e),
            "ttft_p99_over_time": first.ttft_p99_over_time + later.ttft_p99_over_time,
            "ttft_trend": None,  # a slope over two separate windows means nothing
            "request_rate": weighted(first.request_rate, later.request_rate),
            "output_token_rate": weighted(first.output_token_rate, later.output_token_rate),
            "achieved_rate": weighted(first.achieved_rate, later.achieved_rate),
            "unsent": first.unsent + later.unsent,
            "engine": engine,
            "samples": samples,
            "windows": first.windows + later.windows,
        }
    )


def merge_engine_deltas(first: EngineDeltas, later: EngineDeltas, first_n: int, later_n: int) -> EngineDeltas:
    counters = {name: getattr(first, name) + getattr(later, name) for name in COUNTERS}
    total = first_n + later_n

    def mean(a: float | None, b: float | None) -> float | None:
        if a is None or b is None or total == 0:
            return a if b is None else b
        return (a * first_n + b * later_n) / total

    reasons = {
        reason: max(
            first.peak_waiting_by_reason.get(reason, 0.0), later.peak_waiting_by_reason.get(reason, 0.0)
        )
        for reason in {*first.peak_waiting_by_reason, *later.peak_waiting_by_reason}
    }
    return EngineDeltas(
        **counters,
        hit_rate=metrics.hit_rate(counters["prefix_cache_hits"], counters["prefix_cache_queries"]),
        peak_kv_usage=max(first.peak_kv_usage, later.peak_kv_usage),
        peak_running=max(first.peak_running, later.peak_running),
        peak_waiting=max(first.peak_waiting, later.peak_waiting),
        peak_waiting_by_reason=reasons,
        kv_capacity=later.kv_capacity or first.kv_capacity,
        **{name: mean(getattr(first, name), getattr(later, name)) for name in HISTOGRAM_MEANS},
        largest_step_tokens=max(
            (v for v in (first.largest_step_tokens, later.largest_step_tokens) if v is not None),
            default=None,
        ),
        counters_reset=first.counters_reset or later.counters_reset,
    )
