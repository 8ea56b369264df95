"""What a sweep writes down: one record per trial and the run's summary (the JSON files of a run folder).

These models are the contract between the trial runner (which writes them), the report (which reads
them), `--resume` (which trusts finished ones) and the search-efficiency replay (which replays a grid).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, Field

from kvtune.loadgen.results import LoadResult

TrialStatus = Literal["done", "infeasible", "pruned", "failed"]


class RatedStep(Protocol):
    """A load step as the goodput search sees it: its rate and whether it met the SLO."""

    @property
    def rate(self) -> float: ...

    @property
    def passed(self) -> bool: ...


StepT = TypeVar("StepT", bound=RatedStep)


def best_passing_step(steps: Iterable[StepT]) -> StepT | None:
    """The highest-rate step that met the SLO (the step at goodput); None when none did."""
    return max((step for step in steps if step.passed), key=lambda step: step.rate, default=None)


def config_id(knobs: dict[str, Any]) -> str:
    """A short stable name for a config: the same knobs always give the same id."""
    canonical = json.dumps(knobs, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def describe(knobs: dict[str, Any]) -> str:
    """Knobs as a compact human label, e.g. `max_num_seqs=4 block_size=32`."""
    return " ".join(f"{k}={v}" for k, v in knobs.items()) or "(base profile)"


class StepRecord(BaseModel):
    """One load step of a goodput search: a rate, whether it met the SLO, and why not."""

    rate: float = Field(description="intended request rate, per second")
    passed: bool
    misses: list[str] = Field(default_factory=list, description="each SLO target missed, with the figures")
    result: LoadResult


class QualityRecord(BaseModel):
    """The fp8-KV quality gate's figures for a config, against the same config at 16-bit KV."""

    token_agreement: float = Field(description="share of greedy output tokens equal to the reference's")
    logprob_divergence: float = Field(description="mean |delta| of prompt-token log-probs vs the reference")
    min_token_agreement: float
    max_logprob_divergence: float
    passed: bool
    kv_cache_dtype: str = Field(description="the KV dtype the engine really ran (from cache_config_info)")
    prompts: int
    note: str | None = None


class TrialRecord(BaseModel):
    """One config measured once (one repeat): its engine, its goodput search, and what the engine saw."""

    trial: int = Field(description="order in which the sweep ran it, from 1")
    config_id: str
    knobs: dict[str, Any]
    repeat: int = Field(1, ge=1)
    status: TrialStatus
    reason: str | None = Field(None, description="why pruned, infeasible or failed")
    goodput: float = Field(0.0, description="highest rate meeting the SLO; 0 when none did")
    steps: list[StepRecord] = Field(default_factory=list)
    kv_capacity: dict[str, Any] | None = Field(None, description="the engine's real KV pool")
    quality: QualityRecord | None = None
    engine_start_s: float | None = None
    elapsed_s: float = 0.0

    @property
    def best_step(self) -> StepRecord | None:
        return best_passing_step(self.steps)

    @property
    def eligible(self) -> bool:
        """Can this trial's config win: measured, and not failed by the quality gate."""
        return self.status == "done" and (self.quality is None or self.quality.passed)


class ConfigSummary(BaseModel):
    """A config over its repeats."""

    config_id: str
    knobs: dict[str, Any]
    goodputs: list[float]
    mean_goodput: float
    ci95: tuple[float, float] | None = Field(None, description="95% interval of the mean (2+ repeats)")
    eligible: bool
    status: TrialStatus
    reason: str | None = None


class RunSummary(BaseModel):
    """summary.json: every config's standing, the winner, and how the run ended."""

    name: str
    strategy: str
    slo: dict[str, Any]
    base_profile: str
    host_note: str | None = None
    configs: list[ConfigSummary]
    best: ConfigSummary | None = None
    within_noise: str | None = Field(None, description="said when the best two cannot be told apart")
    finished: bool = Field(description="False when the run stopped early (interrupt, budget)")
    stopped_because: str | None = None
    trials_run: int
    elapsed_s: float
