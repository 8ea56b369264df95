"""The step-time law: recovered exactly from points it made, refused where points cannot determine it, and
judged on a real sweep's load steps by leaving each config out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtune.perfmodel.step_law import StepLaw, StepPoint, fit, leave_one_config_out

FIXTURE = Path(__file__).parent / "fixtures" / "perfmodel" / "explore-ladder.json"


def _points(law: StepLaw, config: str, scale: float = 1.0) -> list[StepPoint]:
    # tokens and running vary independently, as they do between light and heavy load steps
    grid = [(10, 1), (25, 5), (60, 12), (40, 3), (75, 9), (15, 8)]
    return [StepPoint(config, t, r, law(t, r) * scale) for t, r in grid]


def test_a_law_is_recovered_from_the_points_it_made() -> None:
    made = StepLaw(a=0.05, b=0.001, c=0.01, relative_sd=0.0, points=0)
    law = fit(_points(made, "x"))
    # e.g. at 60 tokens and 12 running: 0.05 + 0.060 + 0.12 = 0.23 s
    assert law(60, 12) == pytest.approx(0.23)
    assert (law.a, law.b, law.c) == pytest.approx((0.05, 0.001, 0.01))
    assert law.relative_sd == pytest.approx(0.0, abs=1e-9)
    assert law.points == 6
    assert "50.0 ms + 1.000 ms x tokens + 10.00 ms x running" in law.describe()


def test_too_few_or_collinear_points_are_refused() -> None:
    made = StepLaw(a=0.05, b=0.001, c=0.01, relative_sd=0.0, points=0)
    with pytest.raises(ValueError, match="at least 5 load steps; 4 given"):
        fit(_points(made, "x")[:4])
    # running always a tenth of tokens: the two effects cannot be told apart
    line = [StepPoint("x", t, t / 10, 0.05 + 0.002 * t) for t in (10, 20, 30, 40, 50)]
    with pytest.raises(ValueError, match="do not vary tokens per step and running requests independently"):
        fit(line)


@pytest.mark.parametrize(("field", "value"), [("tokens", float("nan")), ("running", -1.0), ("seconds", 0.0)])
def test_a_point_that_is_no_measurement_is_refused(field: str, value: float) -> None:
    fields = {"tokens": 10.0, "running": 2.0, "seconds": 0.1} | {field: value}
    with pytest.raises(ValueError, match=f"step point of c1: {field}|took no time"):
        StepPoint("c1", **fields)


def test_leaving_a_config_out_measures_how_far_it_is_from_the_others_law() -> None:
    made = StepLaw(a=0.05, b=0.001, c=0.01, relative_sd=0.0, points=0)
    points = _points(made, "a") + _points(made, "b") + _points(made, "slow", scale=1.25)
    errors = {e.config: e for e in leave_one_config_out(points)}
    # "slow" takes 1.25x the law the others agree on: |1 - 1.25| / 1.25 = 20% at every step
    assert errors["slow"].median == pytest.approx(0.2)
    assert errors["slow"].worst == pytest.approx(0.2)
    # without "a", the law comes from b and slow: a compromise, so a is off, but by less than slow is
    assert 0 < errors["a"].median < errors["slow"].median


def _fixture_points() -> dict[int, list[StepPoint]]:
    data = json.loads(FIXTURE.read_text())
    groups: dict[int, list[StepPoint]] = {}
    for config in data["configs"]:
        group = groups.setdefault(config["knobs"]["cpu_reserved_cores"], [])
        for step in config["steps"]:
            group.append(
                StepPoint(
                    config["config_id"],
                    step["mean_step_tokens"],
                    step["mean_running"],
                    step["mean_engine_itl_s"],
                )
            )
    return groups


def test_on_a_real_sweep_the_law_predicts_each_step_budget_from_the_others() -> None:
    # Six configs on 2 AVX2 cores: three step budgets, computing on both cores or one. Within each compute
    # group the budget is a batching knob, so a law fitted on two budgets should hold for the third.
    groups = _fixture_points()
    assert sorted(groups) == [0, 1] and all(len(points) >= 20 for points in groups.values())
    for cores_reserved, points in groups.items():
        law = fit(points)
        assert law.a > 0 and law.b > 0 and law.c > 0, (cores_reserved, law.describe())
        held_out = leave_one_config_out(points)
        assert len(held_out) == 3
        for error in held_out:
            assert error.median < 0.15, (cores_reserved, error)
    # one core computing makes each running request cost more than two do
    assert fit(groups[1]).c > fit(groups[0]).c
