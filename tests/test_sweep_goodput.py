"""Goodput search: grow the rate until the SLO breaks, then bisect; SLO misses carry the figures."""

from __future__ import annotations

import math

import pytest

from kvtune.loadgen.results import LoadResult
from kvtune.sweep.goodput import search_goodput, slo_misses, verdicts
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.spec import LoadSearch, Slo
from kvtune.sweep.trial import step_record
from tests.builders import load_result as result


def test_slo_misses_name_the_bound_the_target_and_the_sample() -> None:
    slo = Slo(ttft_p99_s=1.0, itl_p99_s=0.01, max_error_rate=0.05)
    assert slo_misses(verdicts(result(0.5), slo)) == ["ITL p99 ≥ 0.050 s > 0.010 s (1,200 samples)"]
    missed = slo_misses(verdicts(result(2.0, errors=3, unsent=7, requests=90), Slo(ttft_p99_s=1.0)))
    assert missed[0] == "TTFT p99 ≥ 2.000 s > 1.000 s (90 samples)"
    assert missed[1].startswith("error rate ≥ 5.") and missed[1].endswith("> 1.00% (100 samples)")
    assert slo_misses(verdicts(result(0.5), Slo(ttft_p99_s=1.0))) == []


def test_search_doubles_then_bisects_to_the_edge() -> None:
    measured: list[float] = []

    def measure(rate: float, _window: int, _seconds: float, *, continues: bool = False) -> LoadResult:
        measured.append(rate)
        return result(0.2 if rate <= 3.0 else 5.0)

    search = search_goodput(
        measure,
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=0.5, growth=2, bisect_steps=2, confirm_goodput=False),
    )
    assert measured == [0.5, 1.0, 2.0, 4.0, 3.0, 3.5]
    assert search.goodput == 3.0
    assert search.best_step is not None and search.best_step.rate == 3.0


def test_first_step_missing_searches_lower_rates() -> None:
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.2 if rate <= 0.2 else 5.0),
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=1.0, growth=2, bisect_steps=2, confirm_goodput=False),
    )
    assert [step.rate for step in search.steps] == [1.0, 0.5, 0.25]
    assert search.goodput == 0.0  # 0.25 still misses; nothing passed


def test_a_config_that_passes_max_rate_is_searched_above_it_until_a_step_misses() -> None:
    # Passes up to 20 req/s: the planned ladder 1, 2, 4, 8 ends on max_rate, the climb goes on 16, 32.
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.1 if rate <= 20 else 5.0),
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=1, max_rate=8, bisect_steps=0, confirm_goodput=False),
    )
    assert [step.rate for step in search.steps] == [1, 2, 4, 8, 16, 32]
    assert search.goodput == 16  # bracketed: a decided pass at 16, a decided miss at 32
    assert [step.decision for step in search.steps[-2:]] == ["pass", "fail"]


def test_never_breaking_stops_at_an_explicit_rate_cap() -> None:
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.1),
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=1, max_rate=8, rate_cap=20, confirm_goodput=False),
    )
    # Above max_rate the ladder climbs by its factor and ends on the cap: a goodput there is a lower bound.
    assert [step.rate for step in search.steps] == [1, 2, 4, 8, 16, 20]
    assert search.goodput == 20


def test_a_ladder_that_overshoots_max_rate_lands_on_it_then_climbs_from_it() -> None:
    # 0.2 x 1.5 -> 0.3, 0.45, 0.675, 1.0125; the next, 1.52, is above max_rate: 1.1 is tried instead, and
    # above it the ladder goes on from 1.1 (1.65) until the first miss.
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.1 if rate < 1.5 else 5.0),
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=0.2, max_rate=1.1, growth=1.5, bisect_steps=0, confirm_goodput=False),
    )
    assert [round(step.rate, 4) for step in search.steps] == [0.2, 0.3, 0.45, 0.675, 1.0125, 1.1, 1.65]
    assert search.goodput == 1.1


def test_a_claim_checked_at_one_rate_measures_that_rate_alone() -> None:
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.1), Slo(ttft_p99_s=1.0), LoadSearch(max_rate=8).at_one_rate(1.6)
    )
    assert [step.rate for step in search.steps] == [1.6]


def test_the_climb_steps_over_undecided_steps_to_find_a_decided_miss() -> None:
    def measure(rate: float, _w: int, _s: float, *, continues: bool = False) -> LoadResult:
        if rate == 4:  # two requests: too few to bound a p99 from above, none over it: undecided
            return result(0.1, requests=2)
        return result(0.1 if rate <= 2 else 5.0)

    plan = LoadSearch(
        start_rate=1,
        max_rate=16,
        growth=2,
        bisect_steps=0,
        step_seconds=10,
        max_step_seconds=10,
        confirm_goodput=False,
    )
    search = search_goodput(measure, Slo(ttft_p99_s=1.0), plan)
    assert [(s.rate, s.decision) for s in search.steps] == [
        (1, "pass"), (2, "pass"), (4, "undecided"), (8, "fail")
    ]  # fmt: skip
    assert search.goodput == 2  # the undecided 4 does not count; the decided miss at 8 bounds it

    # Three undecided in a row stop the climb without a decided miss above (the goodput stays censored).
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.1, requests=2) if rate >= 4 else result(0.1),
        Slo(ttft_p99_s=1.0),
        plan,
    )
    assert [(s.rate, s.decision) for s in search.steps][2:] == [
        (4, "undecided"), (8, "undecided"), (16, "undecided")
    ]  # fmt: skip
    assert search.goodput == 2


def test_a_rung_just_below_max_rate_counts_as_max_rate_and_is_not_measured_twice() -> None:
    # 0.8 x 1.4^3 = 2.195, a hair below max_rate 2.2: the next rung is 2.195 x 1.4, not 2.2 again.
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.1 if rate < 2.5 else 5.0),
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=0.8, max_rate=2.2, growth=1.4, bisect_steps=0, confirm_goodput=False),
    )
    assert [round(step.rate, 3) for step in search.steps] == [0.8, 1.12, 1.568, 2.195, 3.073]


def test_a_config_missing_the_first_rung_is_measured_one_rung_below_even_without_bisection() -> None:
    search = search_goodput(
        lambda rate, _w, _s, **_: result(0.2 if rate <= 0.6 else 5.0),
        Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=0.8, growth=1.4, bisect_steps=0, confirm_goodput=False),
    )
    assert [round(step.rate, 3) for step in search.steps] == [0.8, 0.571]
    assert search.goodput == pytest.approx(0.8 / 1.4)  # bracketed: passed 0.571, decided to miss 0.8


@pytest.mark.parametrize(
    ("undecided_at", "expected"),
    [
        # The rung below the start is undecided: the next one down is measured and brackets the goodput.
        (0.8, [1.12, 0.8, 0.571]),
        # The rung below passes: the descent stops there (no bisection was asked for).
        (0.0, [1.12, 0.8]),
    ],
)
def test_a_config_passing_no_rung_descends_until_a_rung_passes_and_no_further(
    undecided_at: float, expected: list[float]
) -> None:
    def measure(rate: float, _w: int, _s: float, **_: object) -> LoadResult:
        if math.isclose(rate, undecided_at):  # two requests: too few to bound a p99, none over it
            return result(0.1, requests=2)
        return result(0.2 if rate < 1.0 else 5.0)

    search = search_goodput(
        measure, Slo(ttft_p99_s=1.0),
        LoadSearch(start_rate=1.12, growth=1.4, bisect_steps=0, step_seconds=10, max_step_seconds=10,
                   confirm_goodput=False),
    )  # fmt: skip
    assert [round(step.rate, 3) for step in search.steps] == expected
    assert search.goodput == pytest.approx(expected[-1], abs=1e-3)


def test_the_goodput_rate_is_measured_again_on_its_own_arrivals_and_holds_when_both_samples_pass() -> None:
    windows: list[tuple[float, int]] = []

    def measure(rate: float, window: int, _s: float, *, continues: bool = False) -> LoadResult:
        assert not continues  # every window here is a sample's first: each starts from a cold cache
        windows.append((rate, window))
        return result(0.2 if rate <= 2 else 5.0)

    search = search_goodput(
        measure, Slo(ttft_p99_s=1.0), LoadSearch(start_rate=1, max_rate=4, bisect_steps=0)
    )
    # The second look at 2 req/s starts after the first sample's window: other prompts and arrivals.
    assert windows == [(1, 0), (2, 0), (4, 0), (2, 1)]
    assert [step.sample for step in search.steps] == [1, 1, 1, 2]
    assert search.goodput == 2 and search.best_step is not None and search.best_step.rate == 2
    assert search.steps[-1].summary_line().startswith("2 req/s (sample 2): pass")


def test_a_second_sample_that_misses_lowers_the_goodput_to_the_next_rate_that_holds() -> None:
    # Near saturation 2 req/s passes on one arrival sample and misses on the next; 1 req/s holds on both.
    def measure(rate: float, window: int, _s: float, *, continues: bool = False) -> LoadResult:
        return result(0.2 if rate <= 1 or (rate == 2 and window == 0) else 5.0)

    search = search_goodput(
        measure, Slo(ttft_p99_s=1.0), LoadSearch(start_rate=1, max_rate=4, bisect_steps=0)
    )
    assert [(s.rate, s.sample, s.decision) for s in search.steps] == [
        (1, 1, "pass"), (2, 1, "pass"), (4, 1, "fail"), (2, 2, "fail"), (1, 2, "pass")
    ]  # fmt: skip
    assert search.goodput == 1
    # The record the sweep keeps brackets the goodput by the rate that did not hold.
    record = TrialRecord(
        trial=1, config_id="c", knobs={}, status="done", goodput=search.goodput,
        steps=[step_record(step) for step in search.steps],
    )  # fmt: skip
    assert record.best_step is not None and record.best_step.rate == 1
    assert record.first_decided_miss == 2


def test_an_undecided_second_sample_does_not_hold_and_nothing_held_gives_zero() -> None:
    plan = LoadSearch(start_rate=1, max_rate=2, bisect_steps=0, step_seconds=10, max_step_seconds=10)
    # The second look at 1 req/s has two requests: too few to decide a p99, so 1 req/s does not hold either.
    search = search_goodput(
        lambda rate, window, _s, **_: (
            result(0.1, requests=2) if window else result(0.1 if rate <= 1 else 5.0)
        ),
        Slo(ttft_p99_s=1.0),
        plan,
    )
    # Nothing held, so the rung below (0.5) is measured: it passes once and its second look is undecided too.
    assert [(s.rate, s.decision) for s in search.steps] == [
        (1, "pass"), (2, "fail"), (1, "undecided"), (0.5, "pass"), (0.5, "undecided")
    ]  # fmt: skip
    assert search.goodput == 0 and search.best_step is None


def test_claim_checks_and_held_out_loads_are_one_sample_each() -> None:
    plan = LoadSearch(start_rate=1, max_rate=8)
    assert plan.confirm_goodput and not plan.at_one_rate(2).confirm_goodput
    search = search_goodput(lambda _r, _w, _s, **_: result(0.1), Slo(ttft_p99_s=1.0), plan.at_one_rate(2))
    assert [step.rate for step in search.steps] == [2]


def test_when_no_pass_holds_on_a_second_look_the_rung_below_is_measured_and_confirmed() -> None:
    # The demo's one-core config: 1.12 passes once, 1.57 misses, 1.12's second look is undecided (nothing
    # holds), so 0.8 is measured and looked at again.
    def measure(rate: float, window: int, _s: float, *, continues: bool = False) -> LoadResult:
        if rate == 1.12 and window:
            return result(0.1, requests=2)
        return result(0.2 if rate <= 1.12 else 5.0)

    search = search_goodput(
        measure, Slo(ttft_p99_s=1.0), LoadSearch(start_rate=1.12, max_rate=1.57, growth=1.4, bisect_steps=0)
    )
    assert [(round(s.rate, 2), s.sample, s.decision) for s in search.steps] == [
        (1.12, 1, "pass"), (1.57, 1, "fail"), (1.12, 2, "undecided"), (0.8, 1, "pass"), (0.8, 2, "pass")
    ]  # fmt: skip
    assert search.goodput == pytest.approx(0.8)
