"""An engine's metrics over a window: two scrapes of its /metrics, or a Prometheus server's answers, in;
the window's facts out (counter increases, gauge peaks, histogram means and quantiles).

The one home of the window's rules, so the load results, the sweep's "why", `kvtune doctor` and the router
benchmark read the same figures: one rule for a counter that went down (the engine restarted), one rule for
combining a gauge's series, one quantile from histogram buckets. The two feeds only gather `Readings`;
`WindowFacts.of` turns either into facts, so the same data gives the same facts whichever way it came.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtune import metrics
from kvtune.metrics import ONE_ENGINE, bucket_gap, bucket_problem

# The quantile of TTFT the window reports: the one the alert rules judge (kvtune.observability.alerts).
P99 = 0.99
# The quantiles of block residency the window reports, which the residency alert and `kvtune doctor`
# compare (kvtune.observability.residency says why these two): the reuse gaps' upper tail against the
# median time a block sits idle before it is evicted.
IDLE_QUANTILE = 0.5
REUSE_GAP_QUANTILE = 0.9
# vLLM's waiting reasons (vLLM 0.32.0 `vllm:num_requests_waiting_by_reason`).
WAITING_CAPACITY = "capacity"
WAITING_DEFERRED = "deferred"
RESTARTED = "the engine restarted in the window"


def histogram_parts(name: str) -> tuple[str, str]:
    """A histogram's `_sum` and `_count` samples, by its base name."""
    return f"{name}_sum", f"{name}_count"


# The counters the window counts, in the order a restart is looked for (the first that went down is named).
COUNTERS = (
    metrics.PREFIX_CACHE_HITS,
    metrics.PREFIX_CACHE_QUERIES,
    metrics.PREEMPTIONS,
    metrics.PROMPT_TOKENS,
    metrics.GENERATION_TOKENS,
    metrics.REQUEST_SUCCESS,
)
# Histograms whose mean over the window is a fact (increase of `_sum` / increase of `_count`).
HISTOGRAMS = (
    metrics.TTFT_SECONDS,
    metrics.QUEUE_TIME_SECONDS,
    metrics.PREFILL_TIME_SECONDS,
    metrics.REQUEST_PROMPT_TOKENS,
    metrics.REQUEST_GENERATION_TOKENS,
    metrics.ITL_SECONDS,
    metrics.ITERATION_TOKENS,
)
# Histograms whose buckets the window keeps: a quantile, a largest observation or (the +Inf bucket) a count
# is read from them.
BUCKETED = (metrics.TTFT_SECONDS, metrics.ITERATION_TOKENS, *metrics.BLOCK_RESIDENCY)
# Every sample counted over the window: a restart is one of them going down.
WINDOW_COUNTERS = COUNTERS + tuple(part for name in HISTOGRAMS for part in histogram_parts(name))
# Read once, at the window's end: lifetime counters and the gauges' last values.
END_VALUES = (
    metrics.PREFIX_CACHE_HITS,
    metrics.PREFIX_CACHE_QUERIES,
    *histogram_parts(metrics.REQUEST_PROMPT_TOKENS),
    *histogram_parts(metrics.REQUEST_GENERATION_TOKENS),
    metrics.REQUESTS_RUNNING,
    metrics.REQUESTS_WAITING,
)


# ---- the gauge rule ------------------------------------------------------------------------------------
# A gauge's series (one per engine core of a data-parallel server) are combined by what they measure:
# KV usage is a fraction of ONE core's pool, so the worst core is taken (two half-full pools are not a full
# one, and the fullest is the one about to preempt); requests running and waiting are counts, so they are
# summed (the server holds them all). PromQL's `kv_cache_usage` and `requests_*` read them the same way.


def kv_usage(samples: list[metrics.Sample]) -> float:
    """The fullest engine core's KV usage, 0-1."""
    return max((s.value for s in samples if s.name == metrics.KV_CACHE_USAGE), default=0.0)


def waiting_by_reason(samples: list[metrics.Sample]) -> dict[str, float]:
    """Requests waiting, summed over engine cores, by vLLM's reason."""
    by_reason: dict[str, float] = {}
    for sample in samples:
        if sample.name == metrics.REQUESTS_WAITING_BY_REASON:
            reason = sample.labels.get("reason", "?")
            by_reason[reason] = by_reason.get(reason, 0.0) + sample.value
    return by_reason


@dataclass
class Peaks:
    """Maxima of the engine's gauges over the window, fed with every sample taken in it, and their means
    over those looks (taken at a steady interval, so a time mean: what an autoscaler's `avg_over_time`
    reads, kvtune.observability.scaling_signal)."""

    kv_usage: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    waiting_by_reason: dict[str, float] = field(default_factory=dict)
    # The means' running totals: the scrape feed's bookkeeping (a Prometheus feed reads peaks only), not
    # facts of the window, so two feeds of the same data still compare equal.
    looks: int = field(default=0, compare=False)
    kv_usage_sum: float = field(default=0.0, compare=False)
    running_sum: float = field(default=0.0, compare=False)
    waiting_sum: float = field(default=0.0, compare=False)

    def update(self, samples: list[metrics.Sample]) -> None:
        usage = kv_usage(samples)
        running = metrics.total(samples, metrics.REQUESTS_RUNNING)
        waiting = metrics.total(samples, metrics.REQUESTS_WAITING)
        self.kv_usage = max(self.kv_usage, usage)
        self.running = max(self.running, running)
        self.waiting = max(self.waiting, waiting)
        for reason, value in waiting_by_reason(samples).items():
            self.waiting_by_reason[reason] = max(self.waiting_by_reason.get(reason, 0.0), value)
        self.looks += 1
        self.kv_usage_sum += usage
        self.running_sum += running
        self.waiting_sum += waiting

    def mean(self, total: float) -> float | None:
        """A gauge's mean over the looks, from its running `total`; None before the first look."""
        return total / self.looks if self.looks else None

    @property
    def waiting_for_capacity(self) -> float:
        """Peak of requests waiting for KV or batch room (all waiting ones when the engine has no reasons)."""
        return self.waiting_by_reason.get(WAITING_CAPACITY, self.waiting)


# ---- histograms ----------------------------------------------------------------------------------------


def buckets(samples: list[metrics.Sample], histogram: str) -> dict[float, float]:
    """Cumulative bucket counts by upper bound, summed over label sets; a bound that is no number is
    skipped (nothing can be learnt from it)."""
    counts: dict[float, float] = {}
    for sample in samples:
        if sample.name == f"{histogram}_bucket" and "le" in sample.labels:
            try:
                bound = float(sample.labels["le"])
            except ValueError:
                continue
            counts[bound] = counts.get(bound, 0.0) + sample.value
    return counts


def bucket_quantile(quantile: float, counts: Mapping[float, float]) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative counts by upper bound: linear within a bucket."""
    bounds = sorted(counts)
    if not bounds or bounds[-1] != math.inf or counts[math.inf] <= 0:
        return None
    rank = quantile * counts[math.inf]
    lower, below = 0.0, 0.0
    for bound in bounds:
        count = counts[bound]
        if count >= rank:
            if bound == math.inf:
                return lower  # the highest finite bound, as Prometheus answers
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return None


def bucket_top(counts: Mapping[float, float], observed: float) -> float | None:
    """The upper edge of the lowest bucket holding all `observed` observations: none was larger (None when
    nothing was observed, or only above the last finite edge)."""
    if observed <= 0:
        return None
    return min((edge for edge, n in counts.items() if n >= observed and math.isfinite(edge)), default=None)


# ---- the window ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Readings:
    """What a feed gathered for one window, each figure summed over the metric's series.

    `increases` holds every counter's growth over the window, counted from zero after a restart (as
    Prometheus' increase() does); a name is absent when the feed had no answer for it. `reset_detail` says
    which counter went down, "" when none did; `skipped` names the samples left out (name -> why);
    `impossible` says why what a feed read cannot be one engine's ("" when it can: `readings_problem` looks
    at the figures themselves).
    """

    seconds: float
    increases: Mapping[str, float]
    end: Mapping[str, float]
    buckets: Mapping[str, Mapping[float, float]]
    peaks: Peaks
    reset_detail: str = ""
    skipped: Mapping[str, str] = field(default_factory=dict)
    impossible: str = ""


@dataclass(frozen=True)
class WindowFacts:
    """What the engine did over the window: counter increases, histogram means, gauges.

    Figures are as counted; those in `unknown` are not the window's (a restart cut it, a sample was
    skipped): `known()` clears them for whoever judges the window. When the readings cannot be one engine's,
    `impossible` says why (naming the series) and every figure is unknown: there is nothing to judge.
    """

    seconds: float
    hits: float = 0.0
    queries: float = 0.0
    lifetime_hits: float = 0.0
    lifetime_queries: float = 0.0
    preemptions: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    finished: float = 0.0
    first_tokens: float = 0.0
    mean_ttft_s: float | None = None
    p99_ttft_s: float | None = None
    mean_queue_s: float | None = None
    mean_prefill_s: float | None = None
    mean_prompt_tokens: float | None = None
    mean_output_tokens: float | None = None
    lifetime_mean_prompt_tokens: float | None = None
    lifetime_mean_output_tokens: float | None = None
    running: float = 0.0
    waiting: float = 0.0
    peaks: Peaks = field(default_factory=Peaks)
    counters_reset: bool = False
    # Facts that could not be known, by field name ("hits", "peaks.kv_usage"), with why: a counter that
    # went down, a sample that was skipped.
    unknown: dict[str, str] = field(default_factory=dict)
    reset_detail: str = ""  # which counter went down, from what to what
    mean_itl_s: float | None = None
    mean_step_tokens: float | None = None
    largest_step_tokens: float | None = None
    # KV block residency (vLLM's --kv-cache-metrics), counted over the sampled blocks: whether the engine
    # exports the histograms at all, blocks evicted and reuse gaps observed in the window, and quantiles of
    # their idle time before eviction, reuse gaps and lifetime.
    residency_exported: bool = False
    evicted_blocks: float = 0.0
    reuse_gaps: float = 0.0
    idle_before_evict_s: float | None = None  # at IDLE_QUANTILE
    reuse_gap_s: float | None = None  # at REUSE_GAP_QUANTILE
    reuse_gap_median_s: float | None = None
    block_lifetime_median_s: float | None = None
    impossible: str = ""

    @property
    def traffic(self) -> bool:
        served = (
            self.prompt_tokens + self.generation_tokens + self.finished + self.first_tokens + self.queries
        )
        return served > 0 or self.peaks.running > 0 or self.peaks.waiting > 0

    @property
    def hit_rate(self) -> float | None:
        return metrics.hit_rate(self.hits, self.queries)

    def known(self) -> WindowFacts:
        """These facts with the unknown ones cleared (0, or None for a mean), so no figure stands for them."""
        defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(WindowFacts)}
        return dataclasses.replace(
            self, **{name: defaults[name] for name in self.unknown if name in defaults}
        )

    @classmethod
    def of(cls, readings: Readings) -> WindowFacts:
        problem = readings_problem(readings)
        if problem:
            return cls(readings.seconds, unknown=dict.fromkeys(FACT_SOURCES, problem), impossible=problem)
        increases, end = readings.increases, readings.end

        def increase(name: str) -> float:
            return increases.get(name, 0.0)

        def mean(histogram: str, values: Mapping[str, float]) -> float | None:
            total, count = (values.get(part) for part in histogram_parts(histogram))
            return total / count if total is not None and count is not None and count > 0 else None

        step_buckets = readings.buckets.get(metrics.ITERATION_TOKENS, {})
        idle = readings.buckets.get(metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS, {})
        gaps = readings.buckets.get(metrics.KV_BLOCK_REUSE_GAP_SECONDS, {})
        lifetime = readings.buckets.get(metrics.KV_BLOCK_LIFETIME_SECONDS, {})
        return cls(
            seconds=readings.seconds,
            hits=increase(metrics.PREFIX_CACHE_HITS),
            queries=increase(metrics.PREFIX_CACHE_QUERIES),
            lifetime_hits=end.get(metrics.PREFIX_CACHE_HITS, 0.0),
            lifetime_queries=end.get(metrics.PREFIX_CACHE_QUERIES, 0.0),
            preemptions=increase(metrics.PREEMPTIONS),
            prompt_tokens=increase(metrics.PROMPT_TOKENS),
            generation_tokens=increase(metrics.GENERATION_TOKENS),
            finished=increase(metrics.REQUEST_SUCCESS),
            first_tokens=increase(f"{metrics.TTFT_SECONDS}_count"),
            mean_ttft_s=mean(metrics.TTFT_SECONDS, increases),
            p99_ttft_s=bucket_quantile(P99, readings.buckets.get(metrics.TTFT_SECONDS, {})),
            mean_queue_s=mean(metrics.QUEUE_TIME_SECONDS, increases),
            mean_prefill_s=mean(metrics.PREFILL_TIME_SECONDS, increases),
            mean_prompt_tokens=mean(metrics.REQUEST_PROMPT_TOKENS, increases),
            mean_output_tokens=mean(metrics.REQUEST_GENERATION_TOKENS, increases),
            lifetime_mean_prompt_tokens=mean(metrics.REQUEST_PROMPT_TOKENS, end),
            lifetime_mean_output_tokens=mean(metrics.REQUEST_GENERATION_TOKENS, end),
            running=end.get(metrics.REQUESTS_RUNNING, 0.0),
            waiting=end.get(metrics.REQUESTS_WAITING, 0.0),
            peaks=readings.peaks,
            counters_reset=bool(readings.reset_detail),
            unknown=unknown_facts(readings.skipped, readings.reset_detail),
            reset_detail=readings.reset_detail,
            mean_itl_s=mean(metrics.ITL_SECONDS, increases),
            mean_step_tokens=mean(metrics.ITERATION_TOKENS, increases),
            largest_step_tokens=bucket_top(step_buckets, increase(f"{metrics.ITERATION_TOKENS}_count")),
            residency_exported=bool(idle),
            evicted_blocks=idle.get(math.inf, 0.0),
            reuse_gaps=gaps.get(math.inf, 0.0),
            idle_before_evict_s=bucket_quantile(IDLE_QUANTILE, idle),
            reuse_gap_s=bucket_quantile(REUSE_GAP_QUANTILE, gaps),
            reuse_gap_median_s=bucket_quantile(0.5, gaps),
            block_lifetime_median_s=bucket_quantile(0.5, lifetime),
        )


# Each fact and the samples it is read from: a fact is unknown when one of them was skipped. The window's
# counter increases are also unknown when any counter went down (the engine restarted: every counter
# started again from zero, and one that has grown past its old value hides it).
WINDOW_COUNTER_FACTS: dict[str, tuple[str, ...]] = {
    "hits": (metrics.PREFIX_CACHE_HITS,),
    "queries": (metrics.PREFIX_CACHE_QUERIES,),
    "preemptions": (metrics.PREEMPTIONS,),
    "prompt_tokens": (metrics.PROMPT_TOKENS,),
    "generation_tokens": (metrics.GENERATION_TOKENS,),
    "finished": (metrics.REQUEST_SUCCESS,),
    "first_tokens": (f"{metrics.TTFT_SECONDS}_count",),
    "mean_ttft_s": histogram_parts(metrics.TTFT_SECONDS),
    "p99_ttft_s": (f"{metrics.TTFT_SECONDS}_bucket",),
    "mean_queue_s": histogram_parts(metrics.QUEUE_TIME_SECONDS),
    "mean_prefill_s": histogram_parts(metrics.PREFILL_TIME_SECONDS),
    "mean_prompt_tokens": histogram_parts(metrics.REQUEST_PROMPT_TOKENS),
    "mean_output_tokens": histogram_parts(metrics.REQUEST_GENERATION_TOKENS),
    "mean_itl_s": histogram_parts(metrics.ITL_SECONDS),
    "mean_step_tokens": histogram_parts(metrics.ITERATION_TOKENS),
    "largest_step_tokens": (f"{metrics.ITERATION_TOKENS}_bucket", f"{metrics.ITERATION_TOKENS}_count"),
    "evicted_blocks": (f"{metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS}_bucket",),
    "idle_before_evict_s": (f"{metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS}_bucket",),
    "reuse_gaps": (f"{metrics.KV_BLOCK_REUSE_GAP_SECONDS}_bucket",),
    "reuse_gap_s": (f"{metrics.KV_BLOCK_REUSE_GAP_SECONDS}_bucket",),
    "reuse_gap_median_s": (f"{metrics.KV_BLOCK_REUSE_GAP_SECONDS}_bucket",),
    "block_lifetime_median_s": (f"{metrics.KV_BLOCK_LIFETIME_SECONDS}_bucket",),
}
FACT_SOURCES: dict[str, tuple[str, ...]] = WINDOW_COUNTER_FACTS | {
    "lifetime_hits": (metrics.PREFIX_CACHE_HITS,),
    "lifetime_queries": (metrics.PREFIX_CACHE_QUERIES,),
    "lifetime_mean_prompt_tokens": histogram_parts(metrics.REQUEST_PROMPT_TOKENS),
    "lifetime_mean_output_tokens": histogram_parts(metrics.REQUEST_GENERATION_TOKENS),
    "running": (metrics.REQUESTS_RUNNING,),
    "waiting": (metrics.REQUESTS_WAITING,),
    "peaks.kv_usage": (metrics.KV_CACHE_USAGE,),
    "peaks.running": (metrics.REQUESTS_RUNNING,),
    "peaks.waiting": (metrics.REQUESTS_WAITING,),
    "peaks.waiting_by_reason": (metrics.REQUESTS_WAITING_BY_REASON,),
}


def unknown_facts(skipped: Mapping[str, str], reset_detail: str = "") -> dict[str, str]:
    """Fact -> why it is unknown, from the skipped samples (name -> why) and a restart (when detailed)."""
    unknown: dict[str, str] = {}
    for fact, names in FACT_SOURCES.items():
        for name in names:
            if name in skipped:
                unknown.setdefault(fact, f"{name} {skipped[name]}")
    if reset_detail:
        for fact in WINDOW_COUNTER_FACTS:
            unknown.setdefault(fact, RESTARTED)
    return unknown


# ---- the reset rule ------------------------------------------------------------------------------------


def counter_increase(before: float, after: float) -> float:
    """How much a counter grew; one that went down was reset (its process restarted) and counts from zero
    since, as Prometheus' increase() takes it."""
    return after - before if after >= before else after


def went_down(before: list[metrics.Sample], after: list[metrics.Sample]) -> str:
    """Which counter of the window went down between two scrapes, from what to what ("" when none did):
    an engine restarts all its counters at once, so one going down means it restarted in the window."""
    for name in WINDOW_COUNTERS:
        start, end = metrics.total(before, name), metrics.total(after, name)
        if end < start:
            return f"{name} went down from {start:,.0f} to {end:,.0f}"
    for histogram in BUCKETED:
        start_buckets = buckets(before, histogram)
        for bound, count in buckets(after, histogram).items():
            if count < start_buckets.get(bound, 0.0):
                start = start_buckets[bound]
                return f"{histogram}_bucket{{le={bound:g}}} went down from {start:,.0f} to {count:,.0f}"
    return ""


# ---- the feeds -----------------------------------------------------------------------------------------


def from_snapshots(
    before: list[metrics.Sample],
    after: list[metrics.Sample],
    peaks: Peaks,
    seconds: float,
    skipped: Mapping[str, str] | None = None,
) -> WindowFacts:
    """The window between two scrapes of one engine's /metrics; `peaks` was fed with every scrape in it,
    `skipped` names the samples left out of any of them (name -> why)."""
    return WindowFacts.of(snapshot_readings(before, after, peaks, seconds, skipped))


def snapshot_readings(
    before: list[metrics.Sample],
    after: list[metrics.Sample],
    peaks: Peaks,
    seconds: float,
    skipped: Mapping[str, str] | None = None,
) -> Readings:
    skipped = dict(skipped or {})
    # Samples handed over by a reader that did not check them (read_exposition does) are checked here.
    impossible = metrics.impossible(before, skipped) or metrics.impossible(after, skipped)
    reset_detail = went_down(before, after)
    start = [] if reset_detail else before  # after a restart every counter counts from zero
    ends = {name: buckets(after, name) for name in BUCKETED}
    starts = {name: buckets(start, name) for name in BUCKETED}
    windows = {
        name: {bound: count - starts[name].get(bound, 0.0) for bound, count in ends[name].items()}
        for name in BUCKETED
    }
    return Readings(
        seconds=seconds,
        increases={name: metrics.total(after, name) - metrics.total(start, name) for name in WINDOW_COUNTERS},
        end={name: metrics.total(after, name) for name in END_VALUES},
        buckets={name: _usable(name, windows[name], skipped, ends[name]) for name in BUCKETED},
        peaks=peaks,
        reset_detail=reset_detail,
        skipped=skipped,
        impossible=impossible,
    )


def _usable(
    histogram: str, window: dict[float, float], skipped: dict[str, str], *scraped: Mapping[float, float]
) -> dict[float, float]:
    """The window's bucket counts of HISTOGRAM, or {} (and why, in `skipped`) when they, or the scrape they
    end in, lack the +Inf bucket: a quantile read from them would be nonsense. (Counts that go down are
    no engine's: `readings_problem` refuses them.)"""
    for counts in (*scraped, window):
        problem = bucket_gap(counts)
        if problem:
            skipped.setdefault(f"{histogram}_bucket", problem)
            return {}
    return window


def readings_problem(readings: Readings) -> str:
    """Why a window's readings cannot be one engine's, naming the series ("" when they can be): what the feed
    found (`Readings.impossible`), a counter that shrank, hits that grew faster than queries (or stand above
    them at the end), a gauge's peak below zero or a share's above one, buckets that go down. Both feeds
    meet the same rules, so Prometheus' answers are held to what a scrape is."""
    if readings.impossible:
        return readings.impossible
    usable = {name for name in (*readings.increases, *readings.end) if name not in readings.skipped}
    for values, what in ((readings.increases, "'s increase over the window"), (readings.end, " at its end")):
        for name, value in values.items():
            problem = metrics.value_problem(name, f"{name}{what}", value)
            if problem:
                return problem
        for part, whole in metrics.NEVER_ABOVE.items():
            if part in values and whole in values and {part, whole} <= usable:
                problem = metrics.pair_problem(
                    f"{part}{what}",
                    values[part],
                    f"{whole}{what}",
                    values[whole],
                    metrics.PROMETHEUS_ROUNDING,
                )
                if problem:
                    return problem
    peaks = readings.peaks
    by_reason = metrics.REQUESTS_WAITING_BY_REASON
    gauges = [
        (metrics.KV_CACHE_USAGE, metrics.KV_CACHE_USAGE, peaks.kv_usage),
        (metrics.REQUESTS_RUNNING, metrics.REQUESTS_RUNNING, peaks.running),
        (metrics.REQUESTS_WAITING, metrics.REQUESTS_WAITING, peaks.waiting),
        *(
            (by_reason, metrics.series(by_reason, {"reason": reason}), count)
            for reason, count in peaks.waiting_by_reason.items()
        ),
    ]
    for name, shown, value in gauges:
        problem = metrics.value_problem(name, f"{shown}'s peak over the window", value)
        if problem:
            return problem
    for histogram, counts in readings.buckets.items():
        problem = bucket_problem(counts, metrics.PROMETHEUS_ROUNDING)
        if problem:
            return f"{histogram}_bucket over the window {problem}; {ONE_ENGINE}"
    return ""


# An instant query's answer: one (labels, value as Prometheus writes it: "12", "NaN", "+Inf") per series.
Query = Callable[[str], list[tuple[dict[str, str], str]]]


def _value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def promql_readings(query: Query, selected: Callable[[str], str], window_s: float) -> Readings:
    """The same readings over the last `window_s`, from Prometheus: `query` runs an instant query,
    `selected` adds the label matchers naming one engine to a metric's name.

    Prometheus' increase() counts through a restart, and resets() says whether there was one. The gauges'
    peaks are read over the window at a step fine enough for a thousand points, combined as above.
    """
    window = f"{max(round(window_s), 1)}s"
    step = f"{max(math.ceil(window_s / 1000), 1)}s"
    skipped: dict[str, str] = {}  # metric -> why Prometheus' answer about it was not used

    def finite(answer: list[tuple[dict[str, str], str]], metric: str) -> bool:
        """Every series' value is a finite number; else the metric is skipped."""
        if all(math.isfinite(_value(text)) for _labels, text in answer):
            return True
        skipped.setdefault(metric, "is not a finite number in Prometheus' answer")
        return False

    def scalar(expr: str, metric: str) -> float | None:
        answer = query(expr)
        if not answer:
            return None
        value = _value(answer[0][1])
        if not math.isfinite(value):
            skipped.setdefault(metric, f"is {answer[0][1][:20]} in Prometheus' answer")
            return None
        return value

    def answered(values: dict[str, float | None]) -> dict[str, float]:
        return {name: value for name, value in values.items() if value is not None}

    def peak(expr: str, metric: str) -> float:
        return scalar(f"max_over_time(({expr})[{window}:{step}])", metric) or 0.0

    reset_detail = ""
    for counter in sorted(WINDOW_COUNTERS):  # one query each: resets() drops the name, a sum would merge them
        resets = scalar(f"sum(resets({selected(counter)}[{window}]))", counter)
        if resets:
            reset_detail = f"Prometheus counts {resets:,.0f} resets of {counter} in the last {window}"
            break
    bucket_counts: dict[str, dict[float, float]] = {}
    for histogram in BUCKETED:
        name = f"{histogram}_bucket"
        answer = query(f"sum by (le) (increase({selected(name)}[{window}]))")
        counts = _bounds(answer) if finite(answer, name) else {}
        bucket_counts[histogram] = _usable(histogram, counts, skipped)
    by_reason = f"sum by (reason) ({selected(metrics.REQUESTS_WAITING_BY_REASON)})"
    reasons = query(f"max_over_time(({by_reason})[{window}:{step}])")
    peaks = Peaks(
        kv_usage=peak(f"max({selected(metrics.KV_CACHE_USAGE)})", metrics.KV_CACHE_USAGE),
        running=peak(f"sum({selected(metrics.REQUESTS_RUNNING)})", metrics.REQUESTS_RUNNING),
        waiting=peak(f"sum({selected(metrics.REQUESTS_WAITING)})", metrics.REQUESTS_WAITING),
        waiting_by_reason=(
            {labels.get("reason", "?"): _value(text) for labels, text in reasons}
            if finite(reasons, metrics.REQUESTS_WAITING_BY_REASON)
            else {}
        ),
    )
    increases = {name: scalar(f"sum(increase({selected(name)}[{window}]))", name) for name in WINDOW_COUNTERS}
    end = {name: scalar(f"sum({selected(name)})", name) for name in END_VALUES}
    return Readings(
        seconds=window_s,
        increases=answered(increases),
        end=answered(end),
        buckets=bucket_counts,
        peaks=peaks,
        reset_detail=reset_detail,
        skipped=skipped,
    )


def _bounds(answer: list[tuple[dict[str, str], str]]) -> dict[float, float]:
    """Bucket counts by their `le`; a series without one, or with one that is no number, is left out."""
    counts: dict[float, float] = {}
    for labels, text in answer:
        try:
            counts[float(labels["le"])] = _value(text)
        except (KeyError, ValueError):
            continue
    return counts


def fleet_hit_rate(windows: list[WindowFacts]) -> float | None:
    """Prefix-cache hit rate of several engines together: their hits over their queries, each engine's
    counted over its own window (an engine's restart does not take the others' counts below zero)."""
    return metrics.hit_rate(sum(w.hits for w in windows), sum(w.queries for w in windows))
