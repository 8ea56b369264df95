"""What a sweep writes down: one record per trial and the run's summary (the JSON files of a run folder).

These models are the contract between the trial runner (which writes them), the report (which reads
them), `--resume` (which trusts finished ones) and the search-efficiency replay (which replays a grid).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, computed_field

from kvtune.config_errors import ConfigError, format_loc
from kvtune.documents import read_text
from kvtune.loadgen.results import LoadResult
from kvtune.sweep.confidence import Verdict

TrialStatus = Literal["done", "infeasible", "pruned", "failed"]


class RatedStep(Protocol):
    """A load step as the goodput search sees it: its rate and whether it met the SLO."""

    @property
    def rate(self) -> float: ...

    @property
    def passed(self) -> bool: ...


StepT = TypeVar("StepT", bound=RatedStep)


def best_passing_step(steps: Iterable[StepT]) -> StepT | None:
    """The highest-rate step that met the SLO at a rate where every sample did (the step at goodput; a rate
    looked at again and missed does not hold); None when none did."""
    measured = list(steps)
    not_held = {step.rate for step in measured if not step.passed}
    held = (step for step in measured if step.passed and step.rate not in not_held)
    return max(held, key=lambda step: step.rate, default=None)


def config_id(knobs: dict[str, Any]) -> str:
    """A short stable name for a config: the same knobs always give the same id."""
    canonical = json.dumps(knobs, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:8]


def describe(knobs: dict[str, Any]) -> str:
    """Knobs as a compact human label, e.g. `max_num_seqs=4 block_size=32`."""
    return " ".join(f"{k}={v}" for k, v in knobs.items()) or "(base profile)"


class StepRecord(BaseModel):
    """One load step of a goodput search: a rate, whether it was decided to meet the SLO, and why not."""

    rate: float = Field(description="intended request rate, per second")
    passed: bool = Field(description="decided to meet every target at the SLO's confidence")
    decision: Literal["pass", "fail", "undecided"] | None = Field(
        None, description="undecided: the samples bounded a target neither within nor over it"
    )
    misses: list[str] = Field(
        default_factory=list, description="each target not passed, with its bound, target and sample"
    )
    verdicts: list[Verdict] = Field(default_factory=list, description="each target's bounds and decision")
    sample: int = Field(
        1, ge=1, description="arrival samples measured at this rate, counting this one (2: a confirmation)"
    )
    result: LoadResult

    @property
    def decided(self) -> Literal["pass", "fail", "undecided"]:
        """The decision; a record from before verdicts carried one was a plain pass or miss."""
        return self.decision or ("pass" if self.passed else "fail")

    @property
    def requests_due(self) -> int:
        return self.result.requests + self.result.errors + self.result.unsent

    def verdict(self, repeat: int) -> StepVerdict:
        return StepVerdict(
            repeat=repeat,
            rate=self.rate,
            decision=self.decided,
            sample=self.sample,
            requests=self.requests_due,
            windows=self.result.windows,
            measured_s=self.result.window_s,
            verdicts=self.verdicts,
        )


def widest_ceiling(records: Iterable[TrialRecord]) -> float | None:
    """Over measured repeats, the highest first decided miss: the widest bracket, so a difference called
    decided holds for every repeat. None when a repeat has no decided miss (the goodput is censored) or
    none was measured."""
    misses = [r.first_decided_miss for r in records if r.status == "done"]
    if not misses or None in misses:
        return None
    return max(m for m in misses if m is not None)


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
    worker: str | None = Field(None, description="HOST:PID of the worker that measured it (a shared study)")
    devices: str | None = Field(None, description="the cores or GPUs its engine had (sweep --parallel)")

    @property
    def best_step(self) -> StepRecord | None:
        return best_passing_step(self.steps)

    @property
    def first_decided_miss(self) -> float | None:
        """The lowest rate above the goodput decided to miss the SLO: the true goodput lies below it. None
        when no step above was decided a miss: the goodput is censored (it is only a lower bound)."""
        above = (s.rate for s in self.steps if s.decided == "fail" and s.rate > self.goodput)
        return min(above, default=None)

    @property
    def eligible(self) -> bool:
        """Can this trial's config win: measured, and not failed by the quality gate."""
        return self.status == "done" and (self.quality is None or self.quality.passed)


class StepVerdict(BaseModel):
    """A load step's verdict as summary.json keeps it: the sample it rests on and each target's bounds."""

    repeat: int
    rate: float
    decision: Literal["pass", "fail", "undecided"]
    sample: int = Field(1, ge=1, description="arrival samples measured at this rate, counting this one")
    requests: int = Field(description="requests due in the measured windows (completed, failed, unsent)")
    windows: int = Field(description="measured windows pooled at this rate (more than 1: it was extended)")
    measured_s: float
    verdicts: list[Verdict]


class ConfigSummary(BaseModel):
    """A config over its repeats."""

    config_id: str
    knobs: dict[str, Any]
    goodputs: list[float]
    mean_goodput: float
    ci95: tuple[float, float] | None = Field(None, description="95% interval of the mean (2+ repeats)")
    goodput_ceiling: float | None = Field(
        None,
        description="the lowest rate decided to miss the SLO above the goodput (over repeats, the highest "
        "such rate): the true goodput lies below it; None: no decided miss bounds it (censored)",
    )
    eligible: bool
    status: TrialStatus
    reason: str | None = None
    steps: list[StepVerdict] = Field(default_factory=list, description="every load step's verdict")

    @computed_field  # type: ignore[prop-decorator]
    @property
    def censored(self) -> bool:
        """Measured, but no decided miss bounds its goodput from above: the figure is only a lower bound
        (it passed the top of the ladder, or the steps above it ended undecided)."""
        return self.status == "done" and self.goodput_ceiling is None

    @property
    def lower_bound_only(self) -> bool:
        """Its goodput figure is a lower bound: censored, with some rate passed."""
        return self.censored and self.mean_goodput > 0


class Comparison(BaseModel):
    """Two neighbours in the ranking: which is placed first, whether the measurements decide it, and why."""

    first: str = Field(description="the config placed higher")
    second: str
    decided: bool = Field(
        description="their goodput brackets do not overlap: one passed a rate the other was decided to miss"
    )
    why: str


ValidationRole = Literal["winner", "runner-up", "base", "vllm-defaults"]


class ValidationRecord(BaseModel):
    """One goodput search of the validation step: which config, on which held-out load, which repeat."""

    role: ValidationRole
    label: str = Field(description="the config id, or 'base' / 'vllm-defaults'")
    load: str = Field(description="the held-out load's name")
    record: TrialRecord


# A record keeps every latency its windows measured (LatencySamples), one indented JSON line each: a window of
# 3,000 requests with 256-token answers is ~770,000 inter-token gaps, ~15 MB. A trial of a dozen such steps
# stays well under this; a file past it was not written by a sweep, and is refused rather than read whole.
MAX_RECORD_BYTES = 256 * 1024 * 1024
RecordT = TypeVar("RecordT")


def read_record(
    schema: type[RecordT] | TypeAdapter[RecordT],
    path: Path,
    kind: str,
    fix: str = "remove it to measure again",
) -> RecordT:
    """A record kvtune wrote (KIND: "a trial record"), read with the documents' bounds; one ConfigError
    line naming the file and the FIX when it is too large or damaged."""
    adapter = schema if isinstance(schema, TypeAdapter) else TypeAdapter(schema)
    text = read_text(path, kind, limit=MAX_RECORD_BYTES)
    try:
        return adapter.validate_json(text)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = format_loc(tuple(first["loc"])) or "the document"
        raise ConfigError(f"{path}: is not {kind} kvtune wrote ({where}: {first['msg']}); {fix}") from None


class LoadStanding(BaseModel):
    """One config on one held-out load, over the validation repeats."""

    load: str
    goodputs: list[float]
    mean_goodput: float
    ci95: tuple[float, float] | None = None
    status: TrialStatus
    reason: str | None = None
    first_miss: str | None = Field(
        None, description="why the first missed step missed, in the engine's figures"
    )
    goodput_ceiling: float | None = Field(
        None,
        description="the lowest rate decided to miss above the goodput (over repeats, the highest): None "
        "when no decided miss bounds it (censored; a claim checked at one rate alone always is)",
    )

    @property
    def goodput_min(self) -> float:
        return min(self.goodputs, default=0.0)


class ValidatedConfig(BaseModel):
    """A config (a search winner, runner-up or a baseline) as measured on every held-out load."""

    role: ValidationRole
    label: str
    knobs: dict[str, Any] = Field(default_factory=dict)
    tuned_goodput: float | None = Field(None, description="its goodput in the search (search configs)")
    loads: list[LoadStanding]
    passed: bool | None = Field(None, description="held on held-out load (None: a baseline, not judged)")
    verdict: str = Field("", description="why it passed or failed, with the figures")


# The basis of a ratio whose config held its claimed rate: the figures are rates decided each side.
CLAIM_BASIS = (
    "goodput on held-out load (from its claimed rate, which held) over the baseline's; interval from the "
    "rates decided each side"
)


class GoodputRatio(BaseModel):
    """The validated config's goodput over a baseline's on one held-out load, with a conservative 95%
    interval: the lowest and highest ratios the two means' 95% intervals allow."""

    baseline: str
    load: str
    ratio: float | None = Field(None, description="None when the baseline served nothing within the SLO")
    low: float | None = None
    high: float | None = None
    basis: str = Field(
        "mean goodputs; interval from the two means' 95% intervals", description="what the figures compare"
    )
    open_ends: str | None = Field(
        None, description="why an end of the interval is missing: whose goodput was censored, or was 0"
    )


class ValidationSummary(BaseModel):
    """What the validation step measured and concluded."""

    loads: dict[str, str] = Field(description="held-out load name -> what it is")
    configs: list[ValidatedConfig]
    winner_passed: bool
    holding: str | None = Field(None, description="the best search config that held (the winner or next)")
    ratios: list[GoodputRatio] = Field(default_factory=list)
    settings_note: str | None = Field(None, description="how the deployed settings differ from the trials'")


# Median latencies this close between the sentinel's two measurements are run-to-run noise, not drift.
DRIFT_NOISE = 0.10


class DriftCheck(BaseModel):
    """The sentinel's two measurements at one rate, and what the difference puts in doubt."""

    config_id: str
    rate: float
    ttft_p50_before: float | None
    ttft_p50_after: float | None
    itl_p50_before: float | None
    itl_p50_after: float | None
    drift: float | None = Field(description="largest relative change of the two medians (0.2: 20%)")
    drifted: bool = Field(description="the change is beyond run-to-run noise")
    in_doubt: list[str] = Field(default_factory=list, description="verdicts decided within the drift")
    remeasured: list[str] = Field(default_factory=list, description="contradicting configs measured again")

    def sentence(self) -> str:
        if self.drift is None:
            return f"Sentinel {self.config_id} at {self.rate:.3g} req/s: no completed request to compare."
        change = (
            f"Sentinel {self.config_id} re-measured at {self.rate:.3g} req/s at the end: median TTFT "
            f"{_s(self.ttft_p50_before)} -> {_s(self.ttft_p50_after)}, median ITL "
            f"{_s(self.itl_p50_before)} -> {_s(self.itl_p50_after)}"
        )
        if not self.drifted:
            return f"{change}: within {DRIFT_NOISE:.0%}, the host held steady."
        doubt = (
            f" Verdicts decided within that margin of their target are in doubt: {'; '.join(self.in_doubt)}."
            if self.in_doubt
            else " No verdict was decided that close to its target."
        )
        return f"{change}: the host drifted by {self.drift:.0%} during the sweep.{doubt}"


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f} s"


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
    comparisons: list[Comparison] = Field(
        default_factory=list, description="each ranked config against the next: decided or not, and why"
    )
    envelope: str | None = Field(
        None, description="said when the winner serves shorter requests than the base"
    )
    validation: ValidationSummary | None = None
    drift: DriftCheck | None = Field(None, description="the host-drift check: sentinel and contradictions")
    finished: bool = Field(description="False when the run stopped early (interrupt, budget)")
    stopped_because: str | None = None
    trials_run: int
    elapsed_s: float
