"""Which config serves more, and how sure the sweep is of it.

A config's goodput is bracketed by its steps: a decided pass below (the goodput) and a decided miss above
(`ConfigSummary.goodput_ceiling`); without a decided miss the figure is censored, a lower bound only. Two
configs are told apart when their brackets do not overlap: one passed a rate the other was decided to
miss. When they overlap, the goodputs cannot say which serves more, so they are ranked by how far inside the
SLO each stayed at the highest rate both passed (the margin of its tightest target), and the comparison is
reported as not decided.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvtune.sweep.records import Comparison, ConfigSummary, StepVerdict


@dataclass(frozen=True)
class Bracket:
    """Where a config's true goodput lies: at or above `low`, below `high` (None: nothing bounds it)."""

    low: float
    high: float | None

    def text(self) -> str:
        if self.high is None:
            return f"≥ {self.low:.3g} (censored)"
        return f"[{self.low:.3g}, {self.high:.3g})"


def bracket(config: ConfigSummary) -> Bracket:
    """Over repeats the widest: the lowest goodput below, the config's ceiling above."""
    return Bracket(min(config.goodputs, default=0.0), config.goodput_ceiling)


def decided_above(upper: ConfigSummary, lower: ConfigSummary) -> bool:
    """`upper` was decided to serve more: it passed a rate at or above one `lower` was decided to miss."""
    ceiling = bracket(lower).high
    return ceiling is not None and bracket(upper).low >= ceiling and bracket(upper).low > 0


def _passed(steps: Sequence[StepVerdict], rate: float) -> list[StepVerdict]:
    return [s for s in steps if s.decision == "pass" and math.isclose(s.rate, rate)]


def highest_common_pass(a: ConfigSummary, b: ConfigSummary) -> float | None:
    """The highest rate both configs were decided to pass (every repeat that measured it passed)."""
    rates = {s.rate for s in a.steps if s.decision == "pass"}
    shared = [r for r in rates if _passed(b.steps, r) and _all_passed(a, r) and _all_passed(b, r)]
    return max(shared, default=None)


def _all_passed(config: ConfigSummary, rate: float) -> bool:
    return all(s.decision == "pass" for s in config.steps if math.isclose(s.rate, rate))


def margin_at(config: ConfigSummary, rate: float) -> float | None:
    """How far inside the SLO the config stayed at `rate`: for its tightest latency target, (target - the
    upper confidence bound) / target, the lowest over repeats. None when it did not pass there."""
    margins = [
        (verdict.target - verdict.upper) / verdict.target
        for step in _passed(config.steps, rate)
        for verdict in step.verdicts
        if verdict.name != "error rate" and verdict.upper is not None and verdict.target > 0
    ]
    return min(margins, default=None)


def compare(a: ConfigSummary, b: ConfigSummary) -> int:
    """Negative when `a` ranks first: decided brackets, then the margin where both passed, then goodput."""
    if decided_above(a, b):
        return -1
    if decided_above(b, a):
        return 1
    rate = highest_common_pass(a, b)
    if rate is not None:
        ma, mb = margin_at(a, rate), margin_at(b, rate)
        if ma is not None and mb is not None and ma != mb:
            return -1 if ma > mb else 1
    return (a.mean_goodput < b.mean_goodput) - (a.mean_goodput > b.mean_goodput)


def rank(configs: Sequence[ConfigSummary]) -> list[ConfigSummary]:
    """Configs that can win (eligible, goodput > 0), best first; ties keep first-seen order."""
    contenders = [c for c in configs if c.eligible and c.mean_goodput > 0]
    return sorted(contenders, key=functools.cmp_to_key(compare))


def explain(first: ConfigSummary, second: ConfigSummary) -> Comparison:
    """Why `first` sits above `second`, and whether the measurements decide it."""
    a, b = first.config_id, second.config_id
    brackets = f"{a} {bracket(first).text()}, {b} {bracket(second).text()} req/s"
    if decided_above(first, second):
        why = (
            f"decided: {a} passed {bracket(first).low:.3g} req/s, a rate {b} was decided to miss at or "
            f"below ({brackets})"
        )
        return Comparison(first=a, second=b, decided=True, why=why)
    rate = highest_common_pass(first, second)
    ma = margin_at(first, rate) if rate is not None else None
    mb = margin_at(second, rate) if rate is not None else None
    if rate is not None and ma is not None and mb is not None and ma != mb:
        why = (
            f"not decided (the goodput brackets overlap: {brackets}); ranked by margin at "
            f"{rate:.3g} req/s, the highest rate both passed: {a}'s tightest target {ma:.0%} inside it, "
            f"{b}'s {mb:.0%}"
        )
    else:
        why = f"not decided (the goodput brackets overlap: {brackets}); ranked by goodput"
    return Comparison(first=a, second=b, decided=False, why=why)


def standing(configs: Sequence[ConfigSummary]) -> list[ConfigSummary]:
    """The contenders best first (rank), then the eligible configs that held no rate but were decided to
    miss one: they cannot win, and a contender that passed that rate is decided above them."""
    held_nothing = [c for c in configs if c.eligible and c.mean_goodput == 0 and c.goodput_ceiling]
    return rank(configs) + held_nothing


def comparisons(ranked: Sequence[ConfigSummary]) -> list[Comparison]:
    """Each config against the next one down."""
    return [explain(first, second) for first, second in itertools.pairwise(ranked)]


def goodput_words(config: ConfigSummary, digits: str = ".3g") -> str:
    """A config's goodput as a reader should take it: a censored figure is a lower bound, and says so."""
    text = f"{config.mean_goodput:{digits}} req/s"
    if config.lower_bound_only:
        text = f"≥ {text} (censored: no rate above it was decided to miss)"
    return text
