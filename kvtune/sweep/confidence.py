"""How sure a load step's verdict is: distribution-free confidence bounds on a latency quantile and on a
failure share, from the step's own samples.

A quantile bound comes from order statistics. Of n independent samples, the number below the true
q-quantile is Binomial(n, q), so the k-th fastest sample lies above the quantile with probability
P(Binomial(n, q) < k). The upper bound is the fastest sample for which that probability reaches the
confidence; the lower bound is the slowest sample that lies below the quantile with that probability. A step
passes a target when the upper bound is within it, fails when the lower bound is above it, and is otherwise
undecided. Five requests can never pass a p99 target at 95% (the slowest of five lies above the true p99
with probability 1 - 0.99^5 = 4.9%), but one request over the target among them already fails it.

The failure share is bounded the same way (Clopper-Pearson, the exact binomial interval). With c > 0.5 the
two bounds never both decide, so a verdict is pass, fail or undecided, never both.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

from pydantic import BaseModel, Field
from scipy.stats import beta, binom

Decision = Literal["pass", "fail", "undecided"]


class Verdict(BaseModel):
    """One target judged on one step: the sample, the bounds it supports and what they decide."""

    name: str = Field(description="what was judged, e.g. 'TTFT p90' or 'error rate'")
    target: float
    samples: int = Field(description="samples the bounds rest on (requests; ITL: inter-token gaps)")
    lower: float | None = Field(description="the true figure is above this at the confidence; None: too few")
    upper: float | None = Field(description="the true figure is below this at the confidence; None: too few")
    decision: Decision
    needed: int | None = Field(
        description="samples a pass needs with no more misses than now; None: no sample count can pass"
    )

    def sentence(self, unit: str = " s") -> str:
        """The verdict in words, with the bound that decided it (or the two that left it open)."""

        def shown(value: float | None) -> str:
            if value is None:
                return "?"
            return f"{value:.2%}" if not unit else f"{value:.3f}{unit}"

        target = f"{self.target:.2%}" if not unit else f"{self.target:.3f}{unit}"
        basis = f"{self.samples:,} samples"
        if self.decision == "pass":
            return f"{self.name} ≤ {shown(self.upper)} ≤ {target} ({basis})"
        if self.decision == "fail":
            return f"{self.name} ≥ {shown(self.lower)} > {target} ({basis})"
        if self.upper is None and self.needed is not None:
            return (
                f"{self.name} undecided: {basis} cannot bound it from above; a pass needs {self.needed:,} "
                f"(target {target})"
            )
        between = f"between {shown(self.lower)} and {shown(self.upper)}"
        return f"{self.name} undecided: {between}, target {target} ({basis})"


@functools.lru_cache(maxsize=4096)
def upper_rank(samples: int, quantile: float, confidence: float) -> int | None:
    """1-based rank of the order statistic that bounds the quantile from above; None when no sample does.

    The smallest k with P(Binomial(n, q) <= k - 1) >= confidence."""
    if samples <= 0:
        return None
    k = int(binom.ppf(confidence, samples, quantile)) + 1
    # ppf is the smallest j with cdf(j) >= c; guard its float edge by checking the definition itself.
    while k > 1 and binom.cdf(k - 2, samples, quantile) >= confidence:
        k -= 1
    while k <= samples and binom.cdf(k - 1, samples, quantile) < confidence:
        k += 1
    return k if k <= samples else None


@functools.lru_cache(maxsize=4096)
def lower_rank(samples: int, quantile: float, confidence: float) -> int | None:
    """1-based rank of the order statistic that bounds the quantile from below; None when no sample does.

    The largest j with P(Binomial(n, q) >= j) >= confidence."""
    if samples <= 0:
        return None
    # ppf(1 - c) is the smallest m with cdf(m) >= 1 - c; j - 1 is the largest with cdf(j - 1) <= 1 - c.
    j = int(binom.ppf(1 - confidence, samples, quantile)) + 1
    while j <= samples and binom.sf(j, samples, quantile) >= confidence:
        j += 1
    while j >= 1 and binom.sf(j - 1, samples, quantile) < confidence:
        j -= 1
    return j if j >= 1 else None


def samples_to_pass(quantile: float, confidence: float, over_target: int = 0) -> int:
    """The fewest samples with which a step can pass when `over_target` of them exceed the target.

    The upper bound must leave those samples above it: P(Binomial(n, q) <= n - over - 1) >= c, which is
    P(Binomial(n, 1 - q) <= over) <= 1 - c, the failure-share condition with limit 1 - q."""
    needed = trials_to_pass(over_target, 1 - quantile, confidence)
    if needed is None:  # only a quantile of 1 (the maximum) has no finite sample count
        raise ValueError(f"quantile {quantile} has no upper bound from a finite sample")
    return needed


def judge_quantile(
    name: str, values: list[float], quantile: float, target: float, confidence: float
) -> Verdict:
    """Is the `quantile` of what `values` sample within `target`, at `confidence`?"""
    ordered = sorted(values)
    n = len(ordered)
    up, low = upper_rank(n, quantile, confidence), lower_rank(n, quantile, confidence)
    upper = ordered[up - 1] if up is not None else None
    lower = ordered[low - 1] if low is not None else None
    decision: Decision = "undecided"
    if upper is not None and upper <= target:
        decision = "pass"
    elif lower is not None and lower > target:
        decision = "fail"
    over = sum(1 for value in ordered if value > target)
    needed = samples_to_pass(quantile, confidence, over)
    return Verdict(
        name=name, target=target, samples=n, lower=lower, upper=upper, decision=decision, needed=needed
    )


def judge_share(name: str, failures: int, total: int, limit: float, confidence: float) -> Verdict:
    """Is the true failure share within `limit`, at `confidence`, given `failures` of `total`?"""
    if total <= 0:
        needed = trials_to_pass(0, limit, confidence)
        return Verdict(
            name=name, target=limit, samples=0, lower=None, upper=None, decision="undecided", needed=needed
        )
    upper = 1.0 if failures >= total else float(beta.ppf(confidence, failures + 1, total - failures))
    lower = 0.0 if failures == 0 else float(beta.ppf(1 - confidence, failures, total - failures + 1))
    decision: Decision = "undecided"
    if upper <= limit:
        decision = "pass"
    elif lower > limit:
        decision = "fail"
    needed = trials_to_pass(failures, limit, confidence)
    return Verdict(
        name=name, target=limit, samples=total, lower=lower, upper=upper, decision=decision, needed=needed
    )


# More requests than any load step holds: a limit that would need more is reported as needing this many.
MOST_SAMPLES = 10**12


def clean_samples_to_pass(limit: float, confidence: float) -> int:
    """The fewest samples, none of them a miss, that pass a miss share of `limit` at `confidence`:
    (1 - limit)^n <= 1 - confidence, in closed form so any limit a document gives is answered at once.

    The same count as trials_to_pass(0, limit, confidence) and, with limit 1 - q, samples_to_pass(q, ...)."""
    if limit >= 1:
        return 1
    needed = math.log1p(-confidence) / math.log1p(-limit)  # infinite for a limit below float precision
    if not needed < MOST_SAMPLES:
        return MOST_SAMPLES
    # A product that lands exactly on an integer must not round up past it.
    return max(1, math.ceil(needed - 1e-9))


@functools.lru_cache(maxsize=4096)
def trials_to_pass(failures: int, limit: float, confidence: float) -> int | None:
    """The fewest trials with which `failures` failures still pass `limit`; None when none can (limit 0)."""
    if limit <= 0:
        return None
    # The share's upper bound is the quantile bound in disguise: a pass needs P(Binomial(n, limit) <=
    # failures) <= 1 - confidence.
    n = failures + 1
    while binom.cdf(failures, n, limit) > 1 - confidence:
        n = max(n + 1, math.ceil(n * 1.01))
    # The walk may overshoot by 1%: step back while the smaller n still passes.
    while n - 1 > failures and binom.cdf(failures, n - 1, limit) <= 1 - confidence:
        n -= 1
    return n


def combine(verdicts: list[Verdict]) -> Decision:
    """A step fails when any target fails, passes when every target passes, and is otherwise undecided."""
    decisions = {verdict.decision for verdict in verdicts}
    if "fail" in decisions:
        return "fail"
    return "pass" if decisions == {"pass"} else "undecided"
