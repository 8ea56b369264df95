"""Typed results of one load run: client latencies from per-request samples, and the engine's own record
of the window (read by `kvtune.metrics_window`)."""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, Field

from kvtune import metrics, metrics_window

# Re-exported: the Locust files' reuse report counts its counters with the window's reset rule.
from kvtune.metrics_window import counter_increase as counter_increase


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
    a quantile are computed from. ITL holds every gap of every request; lateness (open loop) each request's
    send after its intended time."""

    ttft: list[float] = Field(default_factory=list)
    itl: list[float] = Field(default_factory=list)
    e2e: list[float] = Field(default_factory=list)
    lateness: list[float] = Field(default_factory=list)

    @classmethod
    def of(
        cls, ttft: list[float], itl: list[float], e2e: list[float], lateness: list[float] | None = None
    ) -> LatencySamples:
        def kept(values: list[float]) -> list[float]:
            return sorted(round(value, 4) for value in values)

        return cls(ttft=kept(ttft), itl=kept(itl), e2e=kept(e2e), lateness=kept(lateness or []))

    def merged(self, other: LatencySamples) -> LatencySamples:
        return LatencySamples.of(
            self.ttft + other.ttft, self.itl + other.itl, self.e2e + other.e2e, self.lateness + other.lateness
        )


# A send this close after its intended time is on time: an idle user wakes from its sleep within a few
# milliseconds; later, it waited for a free user (every one busy) or for a client too busy to wake it.
LATE_TOLERANCE_S = 0.05


class Lateness(BaseModel):
    """Open loop: how long after its intended time each request of the window was sent (sent - intended),
    over `count` requests. Its latencies are counted from the intended time, so a late send is in them."""

    count: int
    p50_s: float | None = None
    p99_s: float | None = None
    max_s: float | None = None
    late: int = Field(0, description="requests sent more than tolerance_s after their intended time")
    tolerance_s: float = LATE_TOLERANCE_S

    @classmethod
    def of(cls, values: list[float]) -> Lateness:
        if not values:
            return cls(count=0)
        p50, p99 = (float(v) for v in np.percentile(values, [50, 99]))
        late = sum(1 for value in values if value > LATE_TOLERANCE_S)
        return cls(count=len(values), p50_s=p50, p99_s=p99, max_s=float(max(values)), late=late)


class TraceCuts(BaseModel):
    """A trace's requests of the window shortened to fit the engine's max_model_len, and the tokens cut."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


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
    mean_kv_usage: float | None = Field(None, description="KV usage (fullest core), mean over the window")
    mean_running: float | None = Field(None, description="requests running, mean over the window")
    mean_waiting: float | None = Field(None, description="requests waiting, mean over the window")
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

    @classmethod
    def of(cls, window: metrics_window.WindowFacts, capacity: metrics.KvCapacity | None) -> EngineDeltas:
        """The load result's record of the engine's window (counted from a restart when there was one)."""
        peaks = window.peaks
        return cls(
            prefix_cache_queries=window.queries,
            prefix_cache_hits=window.hits,
            hit_rate=window.hit_rate,
            preemptions=window.preemptions,
            prompt_tokens=window.prompt_tokens,
            generation_tokens=window.generation_tokens,
            peak_kv_usage=peaks.kv_usage,
            peak_running=peaks.running,
            peak_waiting=peaks.waiting,
            peak_waiting_by_reason=dict(peaks.waiting_by_reason),
            mean_kv_usage=peaks.mean(peaks.kv_usage_sum),
            mean_running=peaks.mean(peaks.running_sum),
            mean_waiting=peaks.mean(peaks.waiting_sum),
            kv_capacity=capacity.__dict__ if capacity else None,
            mean_queue_s=window.mean_queue_s,
            mean_prefill_s=window.mean_prefill_s,
            mean_engine_ttft_s=window.mean_ttft_s,
            mean_engine_itl_s=window.mean_itl_s,
            mean_step_tokens=window.mean_step_tokens,
            largest_step_tokens=window.largest_step_tokens,
            counters_reset=window.counters_reset,
        )


# The record's counters (summed when two windows merge) and histogram means (weighted by requests).
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "preemptions", "prompt_tokens", "generation_tokens")
HISTOGRAM_MEANS = (
    "mean_queue_s",
    "mean_prefill_s",
    "mean_engine_ttft_s",
    "mean_engine_itl_s",
    "mean_step_tokens",
)
# The gauges' means over the window (weighted by window length).
GAUGE_MEANS = ("mean_kv_usage", "mean_running", "mean_waiting")

# Every engine metric a result is computed from: a value of one that is not a finite number makes it nonsense.
READ_METRICS = frozenset(
    {
        *metrics_window.WINDOW_COUNTERS,
        metrics.KV_CACHE_USAGE,
        metrics.REQUESTS_RUNNING,
        metrics.REQUESTS_WAITING,
        metrics.REQUESTS_WAITING_BY_REASON,
    }
)


def _capacity(samples: list[metrics.Sample]) -> metrics.KvCapacity | None:
    try:
        return metrics.KvCapacity.from_samples(samples)
    except ValueError:  # pool labels that are no numbers ("inf"): the window's other figures still stand
        return None


def engine_deltas(
    before: list[metrics.Sample], after: list[metrics.Sample], peaks: metrics_window.Peaks
) -> EngineDeltas:
    """What the engine saw between two scrapes, `peaks` fed with every scrape in between."""
    window = metrics_window.from_snapshots(before, after, peaks, seconds=0.0)
    return EngineDeltas.of(window, _capacity(after))


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
    lateness: Lateness | None = Field(None, description="open loop: how late requests were sent")
    trace_cuts: TraceCuts | None = Field(None, description="a trace: what fitting it to max_model_len cut")
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

    engine = merge_engine_deltas(
        first.engine, later.engine, first.requests, later.requests, (first.window_s, later.window_s)
    )
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
            "lateness": Lateness.of(samples.lateness) if first.lateness and later.lateness else None,
            "trace_cuts": _cuts_merged(first.trace_cuts, later.trace_cuts),
            "engine": engine,
            "samples": samples,
            "windows": first.windows + later.windows,
        }
    )


def _cuts_merged(first: TraceCuts | None, later: TraceCuts | None) -> TraceCuts | None:
    if first is None or later is None:
        return first or later
    return TraceCuts(
        requests=first.requests + later.requests,
        prompt_tokens=first.prompt_tokens + later.prompt_tokens,
        output_tokens=first.output_tokens + later.output_tokens,
    )


def merge_engine_deltas(
    first: EngineDeltas,
    later: EngineDeltas,
    first_n: int,
    later_n: int,
    seconds: tuple[float, float] = (1.0, 1.0),
) -> EngineDeltas:
    """Two windows' engine figures as one: counters summed, peaks the larger, histogram means weighted by
    requests (`first_n`, `later_n`) and gauge means by the windows' `seconds`."""
    counters = {name: getattr(first, name) + getattr(later, name) for name in COUNTERS}

    def weighted(a: float | None, b: float | None, weights: tuple[float, float]) -> float | None:
        if a is None or b is None or sum(weights) <= 0:
            return a if b is None else b
        return (a * weights[0] + b * weights[1]) / sum(weights)

    def mean(a: float | None, b: float | None) -> float | None:
        return weighted(a, b, (first_n, later_n))

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
        **{name: weighted(getattr(first, name), getattr(later, name), seconds) for name in GAUGE_MEANS},
        kv_capacity=later.kv_capacity or first.kv_capacity,
        **{name: mean(getattr(first, name), getattr(later, name)) for name in HISTOGRAM_MEANS},
        largest_step_tokens=max(
            (v for v in (first.largest_step_tokens, later.largest_step_tokens) if v is not None),
            default=None,
        ),
        counters_reset=first.counters_reset or later.counters_reset,
    )
