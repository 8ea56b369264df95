"""An engine's metrics over a window: the reset rule, the gauge rule, quantiles from buckets, and the two
feeds (scrapes, PromQL answers) giving the same facts for the same data."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune import metrics
from kvtune.metrics import ONE_ENGINE, bucket_problem
from kvtune.metrics_window import (
    FACT_SOURCES,
    RESTARTED,
    Peaks,
    WindowFacts,
    bucket_quantile,
    bucket_top,
    counter_increase,
    from_snapshots,
    promql_readings,
)

TTFT = metrics.TTFT_SECONDS
STEPS = metrics.ITERATION_TOKENS


def job_e(name: str) -> str:
    return f'{name}{{job="e"}}'


def sample(name: str, value: float, **labels: str) -> metrics.Sample:
    return metrics.Sample(name, {"model_name": "m", **labels}, value)


def histogram(name: str, counts: dict[str, float], total: float, engine: str = "0") -> list[metrics.Sample]:
    """A histogram's samples: cumulative bucket counts by `le`, its count (the +Inf bucket's) and sum."""
    return [
        *(sample(f"{name}_bucket", count, le=le, engine=engine) for le, count in counts.items()),
        sample(f"{name}_count", counts["+Inf"], engine=engine),
        sample(f"{name}_sum", total, engine=engine),
    ]


def scrape(hits: float, queries: float, preemptions: float, ttft: dict[str, float], ttft_sum: float,
           steps: dict[str, float], steps_sum: float) -> list[metrics.Sample]:  # fmt: skip
    return [
        sample(metrics.PREFIX_CACHE_HITS, hits),
        sample(metrics.PREFIX_CACHE_QUERIES, queries),
        sample(metrics.PREEMPTIONS, preemptions),
        sample(metrics.PROMPT_TOKENS, queries),
        sample(metrics.REQUEST_SUCCESS, ttft["+Inf"], finished_reason="stop"),
        *histogram(TTFT, ttft, ttft_sum),
        *histogram(STEPS, steps, steps_sum),
        sample(metrics.REQUESTS_RUNNING, 3.0),
        sample(metrics.REQUESTS_WAITING, 1.0),
    ]


BEFORE = scrape(100, 1000, 2, {"0.1": 10, "0.25": 10, "0.5": 10, "+Inf": 10}, 0.5,
                {"8": 10, "512": 10, "+Inf": 10}, 40)  # fmt: skip
AFTER = scrape(1000, 2000, 5, {"0.1": 100, "0.25": 109, "0.5": 110, "+Inf": 110}, 10.5,
               {"8": 12, "512": 14, "+Inf": 14}, 740)  # fmt: skip


def test_a_window_counts_increases_and_reads_quantiles_from_bucket_increases() -> None:
    facts = from_snapshots(BEFORE, AFTER, Peaks(), 30.0)
    assert (facts.hits, facts.queries, facts.preemptions, facts.finished) == (900, 1000, 3, 100)
    assert facts.hit_rate == pytest.approx(0.9)
    assert facts.mean_ttft_s == pytest.approx(10.0 / 100)
    # 100 first tokens in the window: 90 at or under 0.1 s, 9 in (0.1, 0.25], 1 in (0.25, 0.5].
    assert facts.p99_ttft_s == pytest.approx(0.25)
    assert facts.largest_step_tokens == 512.0 and facts.mean_step_tokens == 175.0
    assert (facts.lifetime_hits, facts.running, facts.waiting) == (1000, 3, 1)
    assert not facts.counters_reset and facts.unknown == {}


def test_bucket_quantile_and_top_follow_prometheus() -> None:
    counts = {0.1: 90.0, 0.25: 99.0, 0.5: 100.0, math.inf: 100.0}
    assert bucket_quantile(0.5, counts) == pytest.approx(0.1 * 50 / 90)
    assert bucket_quantile(0.995, counts) == pytest.approx(0.375)
    assert bucket_quantile(1.0, {0.1: 1.0, math.inf: 2.0}) == 0.1  # in +Inf: the highest finite bound
    assert bucket_quantile(0.99, {math.inf: 0.0}) is None
    assert bucket_top(counts, 100.0) == 0.5
    assert bucket_top({0.5: 3.0, math.inf: 4.0}, 4.0) is None  # one above the last finite edge
    assert bucket_top(counts, 0.0) is None


def test_a_counter_that_went_down_is_a_restart_counted_from_zero_and_unknown_to_a_judge() -> None:
    restarted = scrape(90, 110, 0, {"0.1": 1, "0.25": 1, "0.5": 1, "+Inf": 1}, 0.05,
                       {"8": 1, "512": 1, "+Inf": 1}, 4)  # fmt: skip
    facts = from_snapshots(BEFORE, restarted, Peaks(), 30.0)
    assert facts.counters_reset
    assert facts.reset_detail == "vllm:prefix_cache_hits_total went down from 100 to 90"
    # Counted from zero since the restart, as Prometheus' increase() does: never below zero.
    assert (facts.hits, facts.queries, facts.preemptions) == (90, 110, 0)
    assert facts.unknown["hits"] == facts.unknown["p99_ttft_s"] == RESTARTED
    assert "lifetime_hits" not in facts.unknown  # the end value is still the engine's
    known = facts.known()
    assert (known.hits, known.queries, known.mean_ttft_s, known.lifetime_hits) == (0, 0, None, 90)
    # A bucket going down is a restart too, even when every total grew past its old value.
    grown = [s for s in AFTER if not (s.name == f"{TTFT}_bucket" and s.labels["le"] == "0.1")]
    grown.append(sample(f"{TTFT}_bucket", 5, le="0.1", engine="0"))
    assert from_snapshots(BEFORE, grown, Peaks(), 30.0).reset_detail == (
        f"{TTFT}_bucket{{le=0.1}} went down from 10 to 5"
    )
    assert counter_increase(100, 90) == 90 and counter_increase(90, 100) == 10


def test_gauges_take_the_fullest_core_s_kv_usage_and_sum_requests() -> None:
    # A data-parallel server: two engine cores, each exporting its own series.
    peaks = Peaks()
    peaks.update([
        sample(metrics.KV_CACHE_USAGE, 0.5, engine="0"),
        sample(metrics.KV_CACHE_USAGE, 0.6, engine="1"),
        sample(metrics.REQUESTS_RUNNING, 4, engine="0"),
        sample(metrics.REQUESTS_RUNNING, 3, engine="1"),
        sample(metrics.REQUESTS_WAITING_BY_REASON, 2, engine="0", reason="capacity"),
        sample(metrics.REQUESTS_WAITING_BY_REASON, 1, engine="1", reason="capacity"),
    ])  # fmt: skip
    peaks.update([sample(metrics.KV_CACHE_USAGE, 0.2), sample(metrics.REQUESTS_RUNNING, 1)])
    assert (peaks.kv_usage, peaks.running, peaks.waiting_by_reason) == (0.6, 7, {"capacity": 3})
    assert peaks.waiting_for_capacity == 3


class FakePrometheus:
    """Answers the window's PromQL from two scrapes, as a Prometheus holding exactly them would."""

    def __init__(self, before: list[metrics.Sample], after: list[metrics.Sample]) -> None:
        self.before, self.after = before, after
        self.asked: list[str] = []

    def query(self, expr: str) -> list[tuple[dict[str, str], str]]:
        self.asked.append(expr)
        if match := re.fullmatch(r"sum\(resets\((\S+)\{job=\"e\"\}\[30s\]\)\)", expr):
            went_down = metrics.total(self.after, match[1]) < metrics.total(self.before, match[1])
            return [({}, "1" if went_down else "0")]
        if match := re.fullmatch(r"sum by \(le\) \(increase\((\S+)\{job=\"e\"\}\[30s\]\)\)", expr):
            bounds: dict[str, float] = {}
            for s in self.after:
                if s.name == match[1]:
                    bounds[s.labels["le"]] = bounds.get(s.labels["le"], 0.0) + s.value
            for s in self.before:
                if s.name == match[1]:
                    bounds[s.labels["le"]] -= s.value
            return [({"le": le}, repr(value)) for le, value in bounds.items()]
        if match := re.fullmatch(r"sum\(increase\((\S+)\{job=\"e\"\}\[30s\]\)\)", expr):
            return [({}, repr(metrics.total(self.after, match[1]) - metrics.total(self.before, match[1])))]
        if match := re.fullmatch(r"sum\((\S+)\{job=\"e\"\}\)", expr):
            return [({}, repr(metrics.total(self.after, match[1])))]
        if "max_over_time" in expr and "by (reason)" in expr:
            return []
        if match := re.fullmatch(r"max_over_time\(\((max|sum)\((\S+)\{job=\"e\"\}\)\)\[30s:1s\]\)", expr):
            values = [s.value for s in self.after if s.name == match[2]]
            if not values:  # no series: Prometheus answers an empty vector
                return []
            return [({}, repr(max(values) if match[1] == "max" else sum(values)))]
        raise AssertionError(f"unexpected query: {expr}")


def test_scrapes_and_promql_give_the_same_facts_for_the_same_data() -> None:
    peaks = Peaks()
    peaks.update(AFTER)
    scraped = from_snapshots(BEFORE, AFTER, peaks, 30.0)
    prometheus = FakePrometheus(BEFORE, AFTER)
    queried = WindowFacts.of(promql_readings(prometheus.query, lambda name: f'{name}{{job="e"}}', 30.0))
    assert queried == scraped
    assert any(expr.startswith("sum(resets(") for expr in prometheus.asked)


def test_promql_answers_that_are_no_numbers_leave_their_facts_unknown() -> None:
    prometheus = FakePrometheus(BEFORE, AFTER)

    def query(expr: str) -> list[tuple[dict[str, str], str]]:
        if expr == f'sum(increase({metrics.PREFIX_CACHE_HITS}{{job="e"}}[30s]))':
            return [({}, "+Inf")]
        return prometheus.query(expr)

    readings = promql_readings(query, lambda name: f'{name}{{job="e"}}', 30.0)
    assert readings.skipped == {metrics.PREFIX_CACHE_HITS: "is +Inf in Prometheus' answer"}
    facts = WindowFacts.of(readings)
    # As from a scrape that skipped the sample: every fact read from that metric is unknown.
    why = "vllm:prefix_cache_hits_total is +Inf in Prometheus' answer"
    assert facts.unknown == {"hits": why, "lifetime_hits": why}
    assert facts.known().hits == 0 and facts.queries == 1000


# ---- block residency ------------------------------------------------------------------------------------

IDLE, GAPS, LIFE = (
    metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS,
    metrics.KV_BLOCK_REUSE_GAP_SECONDS,
    metrics.KV_BLOCK_LIFETIME_SECONDS,
)


def residency(idle: dict[str, float], gaps: dict[str, float], life: dict[str, float]) -> list[metrics.Sample]:
    return [*histogram(IDLE, idle, 0.0), *histogram(GAPS, gaps, 0.0), *histogram(LIFE, life, 0.0)]


RESIDENCY_BEFORE = residency(
    {"2": 0, "5": 10, "10": 10, "+Inf": 10},
    {"1": 0, "2": 5, "5": 5, "10": 5, "+Inf": 5},
    {"5": 5, "10": 10, "+Inf": 10},
)
RESIDENCY_AFTER = residency(
    {"2": 0, "5": 50, "10": 50, "+Inf": 50},
    {"1": 0, "2": 20, "5": 20, "10": 35, "+Inf": 35},
    {"5": 25, "10": 50, "+Inf": 50},
)


def test_residency_facts_are_counts_and_quantiles_of_the_window_s_buckets() -> None:
    facts = from_snapshots(BEFORE + RESIDENCY_BEFORE, AFTER + RESIDENCY_AFTER, Peaks(), 30.0)
    assert facts.residency_exported and (facts.evicted_blocks, facts.reuse_gaps) == (40, 30)
    # 40 evictions idle in (2, 5]: median at rank 20, 2 + 3 x 20 / 40.
    assert facts.idle_before_evict_s == pytest.approx(3.5)
    # 30 gaps, 15 in (1, 2] and 15 in (5, 10]: p90 at rank 27, 5 + 5 x 12 / 15; median at rank 15, 2.
    assert facts.reuse_gap_s == pytest.approx(9.0) and facts.reuse_gap_median_s == pytest.approx(2.0)
    # 40 lifetimes, 20 up to 5 s: the median is that bucket's top.
    assert facts.block_lifetime_median_s == pytest.approx(5.0)
    assert facts.unknown == {}
    plain = from_snapshots(BEFORE, AFTER, Peaks(), 30.0)
    assert not plain.residency_exported and plain.evicted_blocks == 0 and plain.idle_before_evict_s is None


def test_scrapes_and_promql_give_the_same_residency_facts() -> None:
    before, after = BEFORE + RESIDENCY_BEFORE, AFTER + RESIDENCY_AFTER
    scraped = from_snapshots(before, after, Peaks(), 30.0)
    prometheus = FakePrometheus(before, after)
    queried = WindowFacts.of(promql_readings(prometheus.query, lambda name: f'{name}{{job="e"}}', 30.0))
    assert (queried.evicted_blocks, queried.reuse_gaps) == (scraped.evicted_blocks, scraped.reuse_gaps)
    assert queried.idle_before_evict_s == scraped.idle_before_evict_s
    assert queried.reuse_gap_s == scraped.reuse_gap_s


def test_bucket_counts_no_histogram_has_are_named() -> None:
    assert bucket_problem({1.0: 2.0, 2.0: 2.0, math.inf: 3.0}) == ""
    assert bucket_problem({}) == ""  # nothing exported
    assert bucket_problem({1.0: 5.0, 2.0: 3.0, math.inf: 5.0}) == (
        "has 3 observations up to le=2 but 5 up to le=1: buckets count every observation below their bound, "
        "so they never go down"
    )
    assert bucket_problem({1.0: -1.0, math.inf: 2.0}) == "has -1 observations up to le=1: no count is that"
    # Without the +Inf bucket the counts are incomplete, not impossible: the facts are unknown, not refused.
    assert bucket_problem({1.0: 2.0}) == ""
    assert metrics.bucket_gap({1.0: 2.0}) == "has no le=+Inf bucket: the count of all observations is missing"
    # Prometheus extrapolates each bucket's increase() alone: a rounding's worth below is no decrease there;
    # a scrape's own counts are exact.
    rounded = {1.0: 30.000000001, 2.0: 30.0, math.inf: 30.0}
    assert bucket_problem(rounded, metrics.PROMETHEUS_ROUNDING) == ""
    assert bucket_problem(rounded).startswith("has 30 observations up to le=2 but 30 up to le=1")


def test_a_scrape_whose_buckets_go_down_with_le_is_no_engine_s() -> None:
    hostile = residency(
        {"2": 30, "5": 10, "10": 50, "+Inf": 50},
        {"1": 0, "2": 20, "5": 20, "10": 35, "+Inf": 35},
        {"5": 25, "10": 50, "+Inf": 50},
    )
    facts = from_snapshots(BEFORE + RESIDENCY_BEFORE, AFTER + hostile, Peaks(), 30.0)
    assert facts.impossible == (
        f'{IDLE}_bucket{{engine="0",model_name="m"}} has 10 observations up to le=5 but 30 up to le=2: '
        f"buckets count every observation below their bound, so they never go down; {ONE_ENGINE}"
    )
    # Nothing of such a window is a figure: every fact is unknown, and known() clears them all.
    assert set(facts.unknown) == set(FACT_SOURCES) and facts.hit_rate is None
    assert facts.known() == WindowFacts(30.0, unknown=facts.unknown, impossible=facts.impossible)


def test_buckets_that_go_down_only_over_the_window_are_no_engine_s_either() -> None:
    # Each scrape is a histogram, but 20 observations up to 2 s and only 10 up to 5 s joined in between.
    before = residency({"2": 0, "5": 30, "+Inf": 30}, {"+Inf": 0}, {"+Inf": 0})
    after = residency({"2": 20, "5": 40, "+Inf": 40}, {"+Inf": 0}, {"+Inf": 0})
    facts = from_snapshots(BEFORE + before, AFTER + after, Peaks(), 30.0)
    assert facts.impossible == (
        f"{IDLE}_bucket over the window has 10 observations up to le=5 but 20 up to le=2: buckets count "
        f"every observation below their bound, so they never go down; {ONE_ENGINE}"
    )
    # The same window read through Prometheus meets the same rule.
    queried = WindowFacts.of(
        promql_readings(FakePrometheus(BEFORE + before, AFTER + after).query, job_e, 30.0)
    )
    assert queried.impossible == facts.impossible


# ---- numbers no engine exports: refused where metrics are read, by both feeds -----------------------------

COUNTED = (
    metrics.PREFIX_CACHE_HITS,
    metrics.PREFIX_CACHE_QUERIES,
    metrics.PREEMPTIONS,
    metrics.PROMPT_TOKENS,
    metrics.REQUESTS_RUNNING,
    metrics.REQUESTS_WAITING,
)
TTFT_LE = ("0.1", "0.25", "0.5", "+Inf")


@st.composite
def engine_life(draw: st.DrawFn) -> tuple[list[metrics.Sample], list[metrics.Sample]]:
    """Two scrapes of one simulated engine: steps that query prompt tokens and hit some of them, first tokens
    observed into cumulative buckets; the first scrape after some steps, the second after more."""
    steps = draw(st.lists(st.tuples(st.integers(0, 5000), st.floats(0, 1), st.floats(0, 2)), max_size=12))
    cut = draw(st.integers(0, len(steps)))
    usage = draw(st.floats(0, 1))
    scrapes = []
    for taken in (steps[:cut], steps):
        queries = sum(q for q, _, _ in taken)
        hits = sum(int(q * share) for q, share, _ in taken)
        ttft = {le: float(sum(1 for *_, t in taken if t <= float(le))) for le in TTFT_LE}
        samples = scrape(hits, queries, 0, ttft, sum(t for *_, t in taken), {"+Inf": 0}, 0)
        scrapes.append([*samples, sample(metrics.KV_CACHE_USAGE, usage)])
    return scrapes[0], scrapes[1]


def exposition(samples: list[metrics.Sample]) -> str:
    """Samples as a /metrics body (untyped, as a scrape that lost its TYPE lines reads)."""
    lines = []
    for s in samples:
        labels = ",".join(f"{k}={json.dumps(v)}" for k, v in s.labels.items())
        lines.append(f"{s.name}{{{labels}}} {s.value!r}")
    return "\n".join(lines) + "\n"


@settings(max_examples=60, deadline=None)
@given(engine_life())
def test_an_engine_s_own_numbers_are_never_refused(
    life: tuple[list[metrics.Sample], list[metrics.Sample]],
) -> None:
    before, after = life
    for scraped in (before, after):
        assert metrics.impossible(scraped) == ""
        assert metrics.read_exposition(exposition(scraped)).samples == scraped
    peaks = Peaks()
    peaks.update(after)
    scraped_facts = from_snapshots(before, after, peaks, 30.0)
    assert scraped_facts.impossible == ""
    # Prometheus holding the same two scrapes gives the same facts, refused or not.
    assert WindowFacts.of(promql_readings(FakePrometheus(before, after).query, job_e, 30.0)) == scraped_facts


@st.composite
def broken_scrape(draw: st.DrawFn) -> tuple[list[metrics.Sample], str]:
    """A scrape of one engine with one rule broken, and the start of the message that must name it."""
    _, after = draw(engine_life())
    kind = draw(st.sampled_from(["negative", "usage", "hits", "buckets", "twice", "twice-le"]))
    index = {s.name: i for i, s in enumerate(after) if "le" not in s.labels}
    if kind == "negative":
        name = draw(st.sampled_from(COUNTED))
        value = -draw(st.floats(1e-6, 1e12))
        after[index[name]] = sample(name, value)
        return after, f'{name}{{model_name="m"}} = {value:g}: it counts, so it is never negative'
    if kind == "usage":
        value = draw(st.floats(1.0, 1e9, exclude_min=True))
        after[index[metrics.KV_CACHE_USAGE]] = sample(metrics.KV_CACHE_USAGE, value)
        return after, f'{metrics.KV_CACHE_USAGE}{{model_name="m"}} = {value:g}: it is a share, at most 1'
    if kind == "hits":
        queries = after[index[metrics.PREFIX_CACHE_QUERIES]].value
        hits = queries + draw(st.integers(1, 10**9))
        after[index[metrics.PREFIX_CACHE_HITS]] = sample(metrics.PREFIX_CACHE_HITS, hits)
        return after, f'{metrics.PREFIX_CACHE_HITS}{{model_name="m"}} = {hits:,.6g} exceeds'
    buckets = [i for i, s in enumerate(after) if s.name == f"{TTFT}_bucket"]
    if kind == "buckets":
        highest = max(after[i].value for i in buckets)  # no bucket below LOWER goes down first
        top = draw(st.floats(highest + 1, highest + 1e9))
        low = draw(st.floats(0, top, exclude_max=True))
        lower = draw(st.sampled_from(buckets[:-1]))
        after[lower] = dataclasses.replace(after[lower], value=top)
        after[lower + 1] = dataclasses.replace(after[lower + 1], value=low)
        return after, f'{TTFT}_bucket{{engine="0",model_name="m"}} has {low:g} observations up to'
    if kind == "twice":
        copied = draw(st.sampled_from(after))
        value = draw(st.floats(0, 1))  # any value: a series is one number at a time
        return [
            *after,
            dataclasses.replace(copied, value=value),
        ], f"{metrics.series(copied.name, copied.labels)} is exported twice"
    copied = after[buckets[0]]  # le="0.1" and le="0.10": one bucket, written twice
    twin = dataclasses.replace(copied, labels={**copied.labels, "le": "0.10"})
    return [*after, twin], f"{metrics.series(TTFT + '_bucket', twin.labels)} is exported twice"


@settings(max_examples=120, deadline=None)
@given(broken_scrape())
def test_a_scrape_no_engine_exports_is_refused_naming_the_series(
    case: tuple[list[metrics.Sample], str],
) -> None:
    scraped, says = case
    why = metrics.impossible(scraped)
    assert why.startswith(says) and why.endswith(ONE_ENGINE) and "\n" not in why, (why, says)
    # Every reader inherits it: the parser refuses the body, a window ending in it is no window.
    with pytest.raises(metrics.ImpossibleMetrics) as refused:
        metrics.read_exposition(exposition(scraped))
    assert str(refused.value) == why
    facts = from_snapshots(BEFORE, scraped, Peaks(), 30.0)
    assert facts.impossible == why and facts.hit_rate is None and facts.known().queries == 0


@st.composite
def outgrown_window(draw: st.DrawFn) -> tuple[list[metrics.Sample], list[metrics.Sample], float, float]:
    """Two scrapes each an engine's (hits at most queries), between which hits grew more than queries did."""
    queries = draw(st.integers(1, 10**9))
    grew = draw(st.integers(0, 10**6))
    extra = draw(st.integers(1, queries))
    hits = draw(st.integers(0, queries - extra))
    steps = {"+Inf": 0.0}
    before = scrape(hits, queries, 0, {"+Inf": 0}, 0, steps, 0)
    after = scrape(hits + grew + extra, queries + grew, 0, {"+Inf": 0}, 0, steps, 0)
    return before, after, grew + extra, grew


@settings(max_examples=60, deadline=None)
@given(outgrown_window())
def test_hits_growing_faster_than_queries_is_no_window_in_either_feed(
    window: tuple[list[metrics.Sample], list[metrics.Sample], float, float],
) -> None:
    before, after, hits, queries = window
    assert metrics.impossible(before) == metrics.impossible(after) == ""
    scraped = from_snapshots(before, after, Peaks(), 30.0)
    assert scraped.impossible == (
        f"{metrics.PREFIX_CACHE_HITS}'s increase over the window = {hits:,.6g} exceeds "
        f"{metrics.PREFIX_CACHE_QUERIES}'s increase over the window = {queries:,.6g}: {ONE_ENGINE}"
    )
    queried = WindowFacts.of(promql_readings(FakePrometheus(before, after).query, job_e, 30.0))
    assert queried.impossible == scraped.impossible


@pytest.mark.parametrize(
    ("peaks", "says"),
    [
        (Peaks(kv_usage=1.5), f"{metrics.KV_CACHE_USAGE}'s peak over the window = 1.5: it is a share"),
        (Peaks(running=-1), f"{metrics.REQUESTS_RUNNING}'s peak over the window = -1: it counts"),
        (
            Peaks(waiting_by_reason={"capacity\x1b[31m": -2}),
            f'{metrics.REQUESTS_WAITING_BY_REASON}{{reason="capacity\\u001b[31m"}}\'s peak over the window '
            "= -2",
        ),
    ],
)
def test_gauge_peaks_no_engine_reaches_are_refused(peaks: Peaks, says: str) -> None:
    facts = from_snapshots(BEFORE, AFTER, peaks, 30.0)
    assert facts.impossible.startswith(says), facts.impossible
    assert "\x1b" not in facts.impossible  # a label value never reaches the terminal as a control character
