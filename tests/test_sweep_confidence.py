"""Verdicts with confidence: the order-statistic and binomial bounds behind every load step's pass or fail,
checked against known distributions, and the goodput search that measures an undecided step longer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtune.loadgen.results import LatencySamples, LoadResult
from kvtune.sweep.confidence import (
    MOST_SAMPLES,
    clean_samples_to_pass,
    judge_quantile,
    judge_share,
    lower_rank,
    samples_to_pass,
    trials_to_pass,
    upper_rank,
)
from kvtune.sweep.goodput import first_window_seconds, measure_step, search_goodput
from kvtune.sweep.spec import LATENCY_TARGETS, LoadSearch, Slo
from tests.builders import load_result


@pytest.mark.parametrize(
    ("quantile", "confidence", "needed"),
    # 1 - q^n >= c: the slowest of n samples bounds the q-quantile from above at confidence c.
    [
        (0.99, 0.95, 299),
        (0.99, 0.90, 230),
        (0.95, 0.95, 59),
        (0.90, 0.95, 29),
        (0.90, 0.90, 22),
        (0.50, 0.95, 5),
    ],
)
def test_the_fewest_samples_a_pass_needs_is_the_binomial_arithmetic(
    quantile: float, confidence: float, needed: int
) -> None:
    assert 1 - quantile**needed >= confidence > 1 - quantile ** (needed - 1)
    assert samples_to_pass(quantile, confidence) == needed
    fast = [0.1] * needed
    assert judge_quantile("TTFT", fast, quantile, 1.0, confidence).decision == "pass"
    assert judge_quantile("TTFT", fast[:-1], quantile, 1.0, confidence).decision == "undecided"


def test_one_slow_request_of_five_fails_a_p99_but_five_fast_ones_cannot_pass_it() -> None:
    assert upper_rank(5, 0.99, 0.95) is None and lower_rank(5, 0.99, 0.95) == 5
    failed = judge_quantile("TTFT p99", [0.1, 0.1, 0.1, 0.1, 5.0], 0.99, 4.0, 0.95)
    assert failed.decision == "fail" and failed.lower == 5.0
    unsupported = judge_quantile("TTFT p99", [0.1] * 5, 0.99, 4.0, 0.95)
    assert unsupported.decision == "undecided" and unsupported.needed == 299
    assert "5 samples cannot bound it from above; a pass needs 299" in unsupported.sentence()


def test_more_misses_raise_the_samples_a_pass_needs() -> None:
    counts = [samples_to_pass(0.9, 0.9, over) for over in range(5)]
    assert counts == sorted(counts) and len(set(counts)) == 5
    # With `over` samples above the target, the pass needs the upper bound's rank at n - over.
    for over, n in enumerate(counts):
        values = [0.1] * (n - over) + [9.0] * over
        assert judge_quantile("x", values, 0.9, 1.0, 0.9).decision == "pass"
        assert judge_quantile("x", values[1:], 0.9, 1.0, 0.9).decision != "pass"


@pytest.mark.parametrize("confidence", [0.9, 0.95])
@pytest.mark.parametrize("samples", [30, 120])
def test_a_target_the_true_quantile_exceeds_passes_no_more_often_than_the_confidence_allows(
    confidence: float, samples: int
) -> None:
    # Exponential latencies: the true p90 is ln(10) s. A target 2% under it must pass at most 1 - c of the
    # time; one 2% over it must fail at most 1 - c of the time. 2,000 seeded steps each; the margin is
    # four binomial standard deviations of the simulated share.
    rng = np.random.default_rng(7)
    true_p90, steps = math.log(10), 2000
    margin = 4 * math.sqrt((1 - confidence) * confidence / steps)
    draws = rng.exponential(1.0, size=(steps, samples))
    under = [judge_quantile("x", list(d), 0.9, true_p90 * 0.98, confidence).decision for d in draws]
    over = [judge_quantile("x", list(d), 0.9, true_p90 * 1.02, confidence).decision for d in draws]
    assert under.count("pass") / steps <= 1 - confidence + margin
    assert over.count("fail") / steps <= 1 - confidence + margin
    # ... and the bounds are not so wide that they decide nothing: clear cases are decided.
    clear = [judge_quantile("x", list(d), 0.9, true_p90 * 3, confidence).decision for d in draws[:200]]
    assert clear.count("pass") / 200 >= (0.9 if samples >= 120 else 0.5)


def test_the_failure_share_is_bounded_like_a_quantile() -> None:
    assert judge_share("error rate", 0, 22, 0.10, 0.9).decision == "pass"
    assert judge_share("error rate", 0, 21, 0.10, 0.9).decision == "undecided"
    assert judge_share("error rate", 5, 20, 0.10, 0.9).decision == "fail"
    # False passes stay within 1 - c when the true share is just above the limit.
    rng = np.random.default_rng(3)
    failures = rng.binomial(100, 0.11, size=4000)
    passes = sum(judge_share("e", int(f), 100, 0.10, 0.9).decision == "pass" for f in failures)
    assert passes / 4000 <= 0.1 + 4 * math.sqrt(0.09 / 4000)


class ScriptedEngine:
    """A measurement whose windows hold `rate x seconds` requests, `slow_share` of them over the target."""

    def __init__(self, slow_share: dict[float, float]) -> None:
        self.slow_share = slow_share
        self.windows: list[tuple[float, int, float]] = []
        self.continued: list[bool] = []

    def __call__(self, rate: float, window: int, seconds: float, *, continues: bool = False) -> LoadResult:
        self.windows.append((rate, window, seconds))
        self.continued.append(continues)
        requests = max(1, round(rate * seconds))
        slow = round(requests * self.slow_share.get(rate, 1.0))
        ttft = [0.2] * (requests - slow) + [5.0] * slow
        result = load_result(0.2, rate=rate, requests=requests)
        result.window_s = seconds
        result.samples = LatencySamples.of(ttft, [0.05] * requests, ttft)
        return result


P90 = Slo(ttft_p90_s=1.0, confidence=0.9, max_error_rate=0.1)


def test_a_clear_step_is_measured_just_long_enough_to_decide_it() -> None:
    engine = ScriptedEngine({1.0: 0.0})
    step = measure_step(engine, 1.0, P90, LoadSearch(step_seconds=10))
    # 10 requests cannot bound a p90 at 90% (22 needed): one more window, sized for the 12 missing; it
    # goes on from the first window's cache state (no reset: no second cold first request).
    assert step.decision == "pass" and step.result.windows == 2
    assert engine.continued == [False, True]
    assert [w[:2] for w in engine.windows] == [(1.0, 0), (1.0, 1)]
    assert 12 <= engine.windows[1][2] <= 12 * 1.2 + 1e-9
    assert step.result.requests >= 22 and step.result.window_s == sum(w[2] for w in engine.windows)


def test_a_clear_miss_is_decided_on_its_first_window() -> None:
    engine = ScriptedEngine({1.0: 0.5})
    step = measure_step(engine, 1.0, P90, LoadSearch(step_seconds=10))
    assert step.decision == "fail" and len(engine.windows) == 1
    assert step.misses[0].startswith("TTFT p90 ≥ 5.000 s > 1.000 s")


def test_an_undecided_step_is_extended_to_the_cap_and_never_makes_the_goodput() -> None:
    # At 2 req/s 12% of requests are slow: the true p90 is over the target, but by so little that 160
    # requests cannot show it either way at 90%.
    engine = ScriptedEngine({1.0: 0.0, 2.0: 0.12})
    plan = LoadSearch(start_rate=1.0, max_rate=2.0, rate_cap=2.0, growth=2, bisect_steps=0, step_seconds=20,
                      max_step_seconds=80, confirm_goodput=False)  # fmt: skip
    search = search_goodput(engine, P90, plan)
    undecided = search.steps[-1]
    assert undecided.rate == 2.0 and undecided.decision == "undecided"
    assert undecided.result.windows > 1 and undecided.result.window_s <= 80
    assert [rate for rate, _window, _s in engine.windows].count(2.0) == undecided.result.windows
    assert "TTFT p90 undecided: between" in undecided.misses[0]
    assert search.goodput == 1.0 and search.best_step is search.steps[0]


def test_every_latency_target_of_the_table_is_a_field_of_the_slo_and_nothing_else_is() -> None:
    targets = {name for name, _metric, _q in LATENCY_TARGETS}
    assert targets == {name for name in Slo.model_fields if name.endswith("_s")}
    slo = Slo(ttft_p90_s=2.0, itl_p99_s=0.1)
    assert slo.targets() == [("ttft_p90_s", "ttft", 0.9, 2.0), ("itl_p99_s", "itl", 0.99, 0.1)]


@pytest.mark.parametrize("confidence", [0.6, 0.75, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("limit", [0.5, 0.25, 0.1, 0.05, 0.01, 0.001])
def test_the_closed_form_count_of_clean_samples_matches_the_binomial_walk(
    limit: float, confidence: float
) -> None:
    assert clean_samples_to_pass(limit, confidence) == trials_to_pass(0, limit, confidence)


def test_a_tiny_limit_is_answered_at_once_and_capped() -> None:
    assert clean_samples_to_pass(0.01, 0.95) == 299  # 0.99^299 < 0.05 <= 0.99^298
    assert clean_samples_to_pass(1e-320, 0.999999) == MOST_SAMPLES


def test_a_first_window_holds_the_requests_a_pass_needs_within_the_cap() -> None:
    # A TTFT p90 at 90% needs 22 requests. A Poisson count of mean m falls below m - 1.645 sqrt(m) one time
    # in 20: m = 31.2 holds 22 (31.2 - 1.645 x 5.585 = 22.0). At 0.8 req/s that is 39 s; at 2 req/s 20 s
    # holds 40 and stays 20 s; at 0.4 req/s the 48-s cap binds.
    plan = LoadSearch(step_seconds=20, max_step_seconds=48)
    mean = 31.19
    assert mean - 1.645 * mean**0.5 == pytest.approx(22, abs=0.01)
    assert first_window_seconds(0.8, plan, 22) == pytest.approx(mean / 0.8, abs=0.02)
    assert first_window_seconds(2.0, plan, 22) == 20
    assert first_window_seconds(0.4, plan, 22) == 48
    assert first_window_seconds(0.4, plan, 0) == 20
    engine = ScriptedEngine({0.8: 0.0})
    step = measure_step(engine, 0.8, P90, plan, requests_needed=22)
    assert engine.windows[0][2] == pytest.approx(mean / 0.8, abs=0.02)
    assert step.result.windows == 1 and step.decision == "pass"
