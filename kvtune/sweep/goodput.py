"""Goodput of one config: the highest request rate at which the SLO holds.

Rates grow geometrically until a step misses the SLO (or the engine cannot keep up), then bisection narrows
the gap between the last pass and the first miss. The measurement is injected, so the search is tested fast
and the sweep plugs in a real load run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtune.loadgen.results import LoadResult
from kvtune.sweep.records import best_passing_step
from kvtune.sweep.spec import LoadSearch, Slo


def slo_misses(result: LoadResult, slo: Slo) -> list[str]:
    """Every way `result` misses `slo`, worded with the measured value and the target; [] when it holds."""
    misses = []
    checks = (("TTFT p99", result.ttft.p99, slo.ttft_p99_s), ("ITL p99", result.itl.p99, slo.itl_p99_s),
              ("E2E p99", result.e2e.p99, slo.e2e_p99_s))  # fmt: skip
    for name, measured, target in checks:
        if target is None:
            continue
        if measured is None:
            misses.append(f"{name}: no completed request to measure (target {target:.3f} s)")
        elif measured > target:
            misses.append(f"{name} {measured:.3f} s > {target:.3f} s")
    if result.error_rate > slo.max_error_rate:
        misses.append(
            f"error rate {result.error_rate:.1%} > {slo.max_error_rate:.1%} (failed or unsent requests)"
        )
    return misses


@dataclass
class Step:
    rate: float
    result: LoadResult
    misses: list[str]

    @property
    def passed(self) -> bool:
        return not self.misses


@dataclass
class GoodputSearch:
    """The steps measured for one config and the goodput they establish (0 when no step passed)."""

    steps: list[Step] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        best = self.best_step
        return best.rate if best else 0.0

    @property
    def best_step(self) -> Step | None:
        return best_passing_step(self.steps)


def search_goodput(measure: Callable[[float], LoadResult], slo: Slo, plan: LoadSearch) -> GoodputSearch:
    """Find the highest rate meeting `slo`, measuring with `measure(rate)`."""
    search = GoodputSearch()

    def run(rate: float) -> Step:
        result = measure(rate)
        step = Step(rate, result, slo_misses(result, slo))
        search.steps.append(step)
        return step

    passed, missed = 0.0, None
    rate = plan.start_rate
    while True:
        if not run(rate).passed:
            missed = rate
            break
        passed = rate
        if rate >= plan.max_rate:
            break
        # The last step is max_rate itself: a ladder that overshoots it must not stop below it.
        rate = min(rate * plan.growth, plan.max_rate)
    if missed is None:  # never broke within max_rate
        return search
    low, high = passed, missed
    for _ in range(plan.bisect_steps):
        middle = (low + high) / 2 if low else high / plan.growth
        if run(middle).passed:
            low = middle
        else:
            high = middle
    return search
