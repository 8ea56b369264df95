"""How long one engine step takes, fitted from the engine's own figures in the trials measured so far.

The law is linear: seconds = a + b * tokens computed in the step + c * requests running in it. `a` is a step's
fixed cost (scheduling, sampling, the Python around the model), `b` what each computed token adds (prefill
chunks and decodes pass through the same matmuls), `c` what each running request adds beyond its token
(its attention over the KV it has: on the demo's workload every request holds a similar ~500-token context,
so running requests stand for KV tokens read).

Why it can be fitted from load-step means: a load step records the mean tokens per engine step
(`vllm:iteration_tokens_total`), the mean requests running and the mean inter-token latency, which is the
mean duration of the steps a decoding request waited through. For a linear law the mean of the step times is
the law at the mean tokens and the mean running requests, so each load step is one point. The law belongs to
one compute group (the knobs that change the hardware's speed: cores computing, tensor parallelism, KV dtype,
compiled or eager); the batching knobs (step budget, sequences, chunked prefill, pool size) are what the
scheduler simulation varies, so points from configs that differ only in those are pooled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Three coefficients need at least this many points for a residual to say anything about the fit.
MIN_POINTS = 5


@dataclass(frozen=True)
class StepPoint:
    """One load step as the law sees it: its mean step, and the config it was measured on."""

    config: str
    tokens: float  # mean tokens computed per engine step
    running: float  # mean requests running
    seconds: float  # mean step duration (the engine's mean inter-token latency)

    def __post_init__(self) -> None:
        for name in ("tokens", "running", "seconds"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"step point of {self.config}: {name} {value} is not a finite number >= 0")
        if self.seconds <= 0:
            raise ValueError(f"step point of {self.config}: a step of {self.seconds} s took no time")


@dataclass(frozen=True)
class StepLaw:
    """seconds = a + b * tokens + c * running, with the relative spread of the points around it."""

    a: float
    b: float
    c: float
    relative_sd: float  # standard deviation of (measured - law) / law over the fitted points
    points: int

    def __call__(self, tokens: float, running: float) -> float:
        return self.a + self.b * tokens + self.c * running

    def describe(self) -> str:
        return (
            f"step = {self.a * 1000:.1f} ms + {self.b * 1000:.3f} ms x tokens + {self.c * 1000:.2f} ms x "
            f"running (from {self.points} load steps; spread {self.relative_sd:.1%})"
        )


def fit(points: Sequence[StepPoint]) -> StepLaw:
    """The least-squares law through POINTS; ValueError when they cannot determine it."""
    if len(points) < MIN_POINTS:
        raise ValueError(f"a step law needs at least {MIN_POINTS} load steps; {len(points)} given")
    design = np.array([[1.0, p.tokens, p.running] for p in points])
    seconds = np.array([p.seconds for p in points])
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError(
            "the load steps do not vary tokens per step and running requests independently: "
            "measure more rates"
        )
    (a, b, c), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    law = design @ np.array([a, b, c])
    if np.any(law <= 0):
        raise ValueError("the fitted step law gives a step no time at a measured point: measure more rates")
    relative = (seconds - law) / law
    return StepLaw(
        a=float(a),
        b=float(b),
        c=float(c),
        relative_sd=float(np.sqrt(np.mean(relative**2))),
        points=len(points),
    )


@dataclass(frozen=True)
class HeldOutError:
    """The law fitted without one config, judged on that config's load steps."""

    config: str
    median: float  # median of |law - measured| / measured over its steps
    worst: float


def leave_one_config_out(points: Iterable[StepPoint]) -> list[HeldOutError]:
    """For each config, the error of the law fitted on the others' steps: how well it predicts a config
    it never saw (configs whose remaining points cannot determine a law are left out)."""
    every = list(points)
    errors = []
    for config in sorted({p.config for p in every}):
        others = [p for p in every if p.config != config]
        try:
            law = fit(others)
        except ValueError:
            continue
        mine = [abs(law(p.tokens, p.running) - p.seconds) / p.seconds for p in every if p.config == config]
        errors.append(HeldOutError(config, float(np.median(mine)), max(mine)))
    return errors
