"""Goodput of one config: the highest request rate decided, with the SLO's confidence, to meet it.

Rates grow geometrically (past the spec's max_rate while steps pass, up to an explicit rate_cap) until a
step is decided to miss (the engine misses the SLO or cannot keep up), then bisection narrows the gap
between the last pass and the first step that did not pass. Each step's verdict is a confidence bound from
its own samples (kvtune.sweep.confidence): an undecided step is measured longer at the same rate, with fresh
prompts and arrivals, until it is decided or reaches the spec's cap; one still undecided counts as not
passing, and the climb steps over it (twice in a row at most) looking for a decided miss. The goodput's rate
is then measured again on fresh arrivals (confirm_goodput): near saturation one sample passes where another
misses, and a rate counts only when every sample at it passed. The measurement is injected, so the search
is tested fast and the sweep plugs in a real load run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvtune.loadgen.results import LatencySamples, LoadResult, merge_results
from kvtune.sweep.confidence import Decision, Verdict, combine, judge_quantile, judge_share
from kvtune.sweep.records import best_passing_step
from kvtune.sweep.spec import LoadSearch, Slo, quantile_label

# An extension measures at least this share of a step, so a request or two short does not cost a
# Locust start for a few seconds of load.
MIN_EXTENSION_SHARE = 0.25
# Undecided steps in a row the climb steps over before it stops without a decided miss: near its edge an
# engine often sits on the SLO for a rung or two (measured on the demo's baselines: two undecided rungs, then
# a decided miss); a third in a row says more steps would not decide it.
UNDECIDED_STEPPED_OVER = 2
# Rungs below start_rate measured for a config that passed no rung of the ladder (whatever bisect_steps),
# until one passes: the first rung below is often undecided for a config near its edge there (the demo's
# vLLM defaults: 0.8 req/s read TTFT p90 1.38-2.24 s against 2 s, then nothing bounded them from below).
DESCENT_STEPS = 2
# A rung this close below max_rate counts as max_rate itself: 0.8 x 1.4^3 is 2.195, and stepping from there
# to a max_rate of 2.2 would measure the same load twice.
LADDER_TOLERANCE = 0.02
# Requests needed are estimated from the step so far; a little more covers arrival noise.
EXTENSION_MARGIN = 1.2


class Measure(Protocol):
    def __call__(self, rate: float, window: int, seconds: float, /, *, continues: bool = False) -> LoadResult:
        """Measure `seconds` of load at `rate`; `window` counts the windows already measured at it (each
        window needs its own prompts and arrivals, or the samples would repeat). `continues`: the window
        extends the one before it (an undecided step measured longer), so it starts from the cache state
        that window left, as a longer window would have; a new sample starts from the controlled state."""
        ...


def verdicts(result: LoadResult, slo: Slo) -> list[Verdict]:
    """Every SLO target judged on `result`'s samples at the SLO's confidence."""
    samples = result.samples or LatencySamples()
    judged = [
        judge_quantile(quantile_label(metric, q), getattr(samples, metric), q, target, slo.confidence)
        for _name, metric, q, target in slo.targets()
    ]
    due = result.requests + result.errors + result.unsent
    judged.append(
        judge_share("error rate", result.errors + result.unsent, due, slo.max_error_rate, slo.confidence)
    )
    return judged


def slo_misses(judged: list[Verdict]) -> list[str]:
    """Each target the step did not pass, worded with its bound, the target and the sample; [] on a pass."""
    return [
        verdict.sentence("" if verdict.name == "error rate" else " s")
        for verdict in judged
        if verdict.decision != "pass"
    ]


@dataclass
class Step:
    rate: float
    result: LoadResult
    verdicts: list[Verdict]
    # Arrival samples measured at this rate, counting this one: 2 or more is the goodput's confirmation.
    sample: int = 1

    @property
    def decision(self) -> Decision:
        return combine(self.verdicts)

    @property
    def passed(self) -> bool:
        return self.decision == "pass"

    @property
    def misses(self) -> list[str]:
        return slo_misses(self.verdicts)

    def summary_line(self) -> str:
        """The step's verdict in one line, for progress: its sample, and what decided it or left it open."""
        requests = self.result.requests + self.result.errors + self.result.unsent
        windows = f" in {self.result.windows} windows" if self.result.windows > 1 else ""
        again = f" (sample {self.sample})" if self.sample > 1 else ""
        head = f"{self.rate:.3g} req/s{again}: {self.decision} on {requests:,} requests{windows}"
        return head if self.passed else f"{head}: {'; '.join(self.misses)}"


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


def extension_seconds(step: Step, plan: LoadSearch) -> float:
    """How long to measure an undecided step further: the requests its undecided targets still need at
    this rate, within the cap; 0 when the cap is spent or no sample count could decide it."""
    left = plan.step_cap_seconds - step.result.window_s
    if left <= 0:
        return 0.0
    due = max(1, step.result.requests + step.result.errors + step.result.unsent)
    more_requests = 0.0
    for verdict in step.verdicts:
        if verdict.decision != "undecided" or verdict.needed is None:
            continue
        # ITL samples are gaps: so many per request on average.
        per_request = verdict.samples / due if verdict.samples else 1.0
        more_requests = max(more_requests, (verdict.needed - verdict.samples) / max(per_request, 1e-9))
    if more_requests <= 0:
        # The sample is large enough but sits on the target: more of it may still decide.
        more_requests = due
    seconds = more_requests / step.rate * EXTENSION_MARGIN
    return min(left, max(seconds, plan.step_seconds * MIN_EXTENSION_SHARE))


def first_window_seconds(rate: float, plan: LoadSearch, requests_needed: int) -> float:
    """A step's first window: step_seconds, or longer (up to the cap) when fewer requests than a pass needs
    would arrive in it. Every window costs a Locust start, so a step measured in one window costs less
    than a short window and its extension."""
    if requests_needed <= 0:
        return plan.step_seconds
    # Poisson arrivals: the mean m whose one-sided 95% low end (normal approximation, m - z sqrt(m)) still
    # holds the requests, so the first window rarely needs an extension. 22 requests: m = 31.2.
    z = 1.645
    mean = ((z + math.sqrt(z * z + 4 * requests_needed)) / 2) ** 2
    return min(plan.step_cap_seconds, max(plan.step_seconds, mean / rate))


def measure_step(
    measure: Measure, rate: float, slo: Slo, plan: LoadSearch, *,
    windows_before: int = 0, sample: int = 1, requests_needed: int = 0,
) -> Step:  # fmt: skip
    """One rate, measured until its verdict is decided or the cap is reached. `windows_before` counts the
    windows other samples already measured at this rate, so this one draws its own prompts and arrivals;
    `requests_needed` (the fewest a pass needs) sizes the first window."""
    result = measure(rate, windows_before, first_window_seconds(rate, plan, requests_needed))
    step = Step(rate, result, verdicts(result, slo), sample)
    while step.decision == "undecided":
        seconds = extension_seconds(step, plan)
        if seconds <= 0 or not math.isfinite(seconds):
            break
        more = measure(rate, windows_before + step.result.windows, seconds, continues=True)
        result = merge_results(step.result, more)
        step = Step(rate, result, verdicts(result, slo), sample)
    return step


def search_goodput(
    measure: Measure,
    slo: Slo,
    plan: LoadSearch,
    on_step: Callable[[Step], None] | None = None,
    requests_needed: int = 0,
) -> GoodputSearch:
    """Find the highest rate decided to meet `slo`, measuring with `measure`; `on_step` hears each verdict;
    `requests_needed` (the fewest a pass needs) sizes each step's first window."""
    search = GoodputSearch()

    def run(rate: float) -> Step:
        earlier = [step for step in search.steps if step.rate == rate]
        step = measure_step(
            measure, rate, slo, plan,
            windows_before=sum(step.result.windows for step in earlier), sample=len(earlier) + 1,
            requests_needed=requests_needed,
        )  # fmt: skip
        search.steps.append(step)
        if on_step is not None:
            on_step(step)
        return step

    # `missed` is the lowest rate above `passed` that did not pass: bisection narrows the gap between them.
    passed, missed, undecided_in_a_row = 0.0, None, 0
    rate = min(plan.start_rate, plan.ceiling)
    while True:
        step = run(rate)
        if step.passed:
            passed, missed, undecided_in_a_row = rate, None, 0
        else:
            missed = rate if missed is None else missed
            undecided_in_a_row = undecided_in_a_row + 1 if step.decision == "undecided" else 0
            # A decided miss ends the climb. An undecided step does not count as passing, but the climb
            # steps over it (at most UNDECIDED_STEPPED_OVER in a row) looking for a decided miss to bracket
            # the goodput from above.
            if step.decision == "fail" or undecided_in_a_row > UNDECIDED_STEPPED_OVER:
                break
        if rate >= plan.ceiling:
            break  # the cap: a goodput there is a lower bound, and the report says so
        # The planned ladder lands on max_rate itself (every config is compared there); above it the climb
        # goes on by the same factor until a step misses, so the goodput is bracketed by a decided miss.
        at_top = rate >= plan.max_rate * (1 - LADDER_TOLERANCE)
        rate = rate * plan.growth if at_top else min(rate * plan.growth, plan.max_rate)
        rate = min(rate, plan.ceiling)
    if missed is not None:  # broke below the cap: narrow the gap
        low, high = passed, missed
        # A config that passed nothing is measured at least one rung below the ladder's start (high /
        # growth), so its goodput is bracketed from below too rather than left at "less than the first rate".
        for index in range(plan.bisect_steps if passed else max(plan.bisect_steps, DESCENT_STEPS)):
            if low and index >= plan.bisect_steps:
                break  # the rungs beyond bisect_steps look for a pass below the start: one passed
            middle = (low + high) / 2 if low else high / plan.growth
            if run(middle).passed:
                low = middle
            else:
                high = middle
    if plan.confirm_goodput:
        confirm(search, run)
        if search.best_step is None and passed:
            # The climb's passes did not hold on a second look: the rung below them is measured, as for a
            # config that passed nothing, so the goodput is bracketed from below.
            run(min(step.rate for step in search.steps) / plan.growth)
            confirm(search, run)
    return search


def confirm(search: GoodputSearch, run: Callable[[float], Step]) -> None:
    """Measure the goodput's rate again on a fresh sample until a rate holds on both: a rate counts as
    passed only when every sample at it passed (best_passing_step), so a second look that misses lowers the
    goodput to the next rate that passed, which is then looked at again in turn."""
    confirmed: set[float] = set()
    while (best := search.best_step) is not None and best.rate not in confirmed:
        confirmed.add(best.rate)
        run(best.rate)
