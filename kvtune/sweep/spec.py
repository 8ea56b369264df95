"""The sweep spec: which engine knobs to search, under which load, against which latency SLO.

Every candidate value is checked against the base engine profile before any engine starts, so a bad knob,
value, empty space or impossible SLO fails with the field path and the fix.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvtune.config_errors import DocumentModel, brief, existing_file
from kvtune.documents import load_yaml_model
from kvtune.files import name_problem
from kvtune.loadgen.runner import WorkloadName
from kvtune.loadgen.workload_args import (
    DEFAULT_MAX_TOKENS,
    MOST_MAX_TOKENS,
    MOST_USERS,
    WorkloadError,
    validate_workload_args,
)
from kvtune.profile import EngineProfile, is_loopback, knobs, load_profile
from kvtune.profile.knob_values import problem as knob_problem
from kvtune.sweep.confidence import clean_samples_to_pass
from kvtune.sweep.envelope import ENVELOPE_KNOBS, context_tokens, longest_request
from kvtune.sweep.quality import QualityGate
from kvtune.sweep.strategies import grid_configs

# The profile fields a sweep may vary (the KV budget, cache and batching knobs, the CPU build's thread
# placement): each field's FieldFacts says which (kvtune.profile.model).
KNOBS: tuple[str, ...] = knobs(EngineProfile)


# More values than this in one range is a typo (a step of 1 byte), not a sweep anyone can run.
MAX_RANGE_VALUES = 10_000
# Every model of a spec refuses .inf and .nan (allow_inf_nan=False): where a number is meant, they are typos.


class Range(DocumentModel):
    """An inclusive numeric range, sampled at `step` (grid) or anywhere inside (model-based search)."""

    min: float = Field(allow_inf_nan=False, description="smallest value")
    max: float = Field(allow_inf_nan=False, description="largest value")
    step: float = Field(gt=0, allow_inf_nan=False, description="grid spacing")

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.max < self.min:
            raise ValueError(f"max {self.max} is below min {self.min}; swap them")
        count = (self.max - self.min) / self.step + 1
        if count > MAX_RANGE_VALUES:
            raise ValueError(
                f"min {self.min:g} to max {self.max:g} in steps of {self.step:g} gives {count:,.0f} values, "
                f"more than the {MAX_RANGE_VALUES:,} a sweep can plan; raise step or narrow the range"
            )
        return self

    def values(self) -> list[float]:
        count = round((self.max - self.min) / self.step) + 1
        return [round(self.min + i * self.step, 10) for i in range(count)]


class WorkloadSpec(DocumentModel):
    name: WorkloadName = Field(
        "shared_prefix", description="a workload of kvtune.loadgen.locustfiles (flags: `kvtune load --help`)"
    )
    args: dict[str, str | int | float] = Field(
        default_factory=dict, description="the workload's own flags, e.g. {system-tokens: 800}"
    )
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, ge=1, le=MOST_MAX_TOKENS, description="output tokens per request"
    )
    users: int = Field(8, ge=1, le=MOST_USERS, description="most requests in flight (open loop)")
    ignore_eos: bool = Field(True, description="always generate max_tokens, so every config does equal work")

    @field_validator("args")
    @classmethod
    def _args_are_the_workloads(
        cls, args: dict[str, str | int | float], info: ValidationInfo
    ) -> dict[str, str | int | float]:
        """Checked as the workload's own Locust flags would be, so a typo fails here and not after the
        first engine started; a relative replay file is taken from the spec's folder."""
        if "name" not in info.data:
            return args  # the workload name itself is wrong: that error is reported
        try:
            return validate_workload_args(
                info.data["name"], args, base_dir=(info.context or {}).get("base_dir")
            )
        except WorkloadError as exc:
            raise ValueError(str(exc)) from None


# The latency targets an SLO can set: (field, metric, quantile). One table, read by the verdicts, the report
# and the validators, so a further quantile is one row (and its field below).
LATENCY_TARGETS: tuple[tuple[str, Literal["ttft", "itl", "e2e"], float], ...] = tuple(
    (f"{metric}_p{round(q * 100)}_s", metric, q)
    for metric in ("ttft", "itl", "e2e")
    for q in (0.50, 0.90, 0.95, 0.99)
)
METRIC_NAMES = {"ttft": "TTFT", "itl": "ITL", "e2e": "E2E"}


def quantile_label(metric: str, quantile: float) -> str:
    """How a target is named in verdicts and reports, e.g. 'TTFT p90'."""
    return f"{METRIC_NAMES[metric]} p{round(quantile * 100)}"


def _target(what: str) -> Any:
    return Field(None, gt=0, allow_inf_nan=False, description=f"{what}, seconds")


class Slo(DocumentModel):
    """Latency-quantile targets a config must meet at a load for that load to count, and how sure a step's
    verdict must be (distribution-free bounds from the step's own samples: kvtune.sweep.confidence)."""

    ttft_p50_s: float | None = _target("median time to first token")
    ttft_p90_s: float | None = _target("P90 time to first token")
    ttft_p95_s: float | None = _target("P95 time to first token")
    ttft_p99_s: float | None = _target("P99 time to first token")
    itl_p50_s: float | None = _target("median inter-token latency")
    itl_p90_s: float | None = _target("P90 inter-token latency")
    itl_p95_s: float | None = _target("P95 inter-token latency")
    itl_p99_s: float | None = _target("P99 inter-token latency")
    e2e_p50_s: float | None = _target("median end-to-end latency")
    e2e_p90_s: float | None = _target("P90 end-to-end latency")
    e2e_p95_s: float | None = _target("P95 end-to-end latency")
    e2e_p99_s: float | None = _target("P99 end-to-end latency")
    max_error_rate: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="share of failed or unsent requests allowed (a bound, like the quantiles)",
    )
    confidence: float = Field(
        0.95,
        gt=0.5,
        lt=1,
        allow_inf_nan=False,
        description="how sure a step's pass or fail must be; between the two bounds a step is undecided "
        "and measured longer",
    )

    def targets(self) -> list[tuple[str, str, float, float]]:
        """(field, metric, quantile, target) for every latency target set, in the table's order."""
        return [
            (name, metric, q, target)
            for name, metric, q in LATENCY_TARGETS
            if (target := getattr(self, name)) is not None
        ]

    @model_validator(mode="after")
    def _something_to_meet(self) -> Self:
        targets = self.targets()
        if not targets:
            raise ValueError(
                "set at least one latency target, e.g. ttft_p90_s or itl_p99_s (any of "
                f"{', '.join(name for name, _m, _q in LATENCY_TARGETS)})"
            )
        ttft = min((t for _n, metric, _q, t in targets if metric == "ttft"), default=None)
        for name, metric, _q, target in targets:
            if metric == "e2e" and ttft is not None and target < ttft:
                raise ValueError(
                    f"{name} {target} is below the TTFT target {ttft}: no request can meet both (a request "
                    f"ends after its first token); raise {name}"
                )
        return self


LONGEST_STEP_S = 86400  # a day: the most one rate is measured
LONGEST_SWEEP_MINUTES = 30 * 24 * 60  # a month: longer is a typo, not a budget


# No ladder climbs past this: a rate no engine serves, the same bound as any rate the spec may give.
HIGHEST_RATE = 1e6


class LoadSearch(DocumentModel):
    """How goodput is found for one config: rates grow until the SLO breaks, then bisection.

    Every config climbs the same ladder (start_rate x growth^k, landing on max_rate), so configs share the
    rates they are compared at. A config that passes max_rate climbs on above it until a step misses, so its
    goodput is bracketed by a decided pass and a decided miss; only rate_cap, set explicitly, stops the
    climb, and a goodput at the cap is reported as a lower bound (censored)."""

    start_rate: float = Field(
        0.5, ge=0.001, le=HIGHEST_RATE, description="first request rate tried, per second"
    )
    max_rate: float = Field(
        32.0,
        ge=0.001,
        le=HIGHEST_RATE,
        description="top of the planned ladder; a config passing it is searched above it until a step misses",
    )
    rate_cap: float | None = Field(
        None,
        ge=0.001,
        le=HIGHEST_RATE,
        description="never measure above this rate; a config that passes it is reported as serving at least "
        "the cap (censored: nothing bounds its goodput from above). Default: no cap",
    )
    growth: float = Field(2.0, gt=1, le=100, allow_inf_nan=False, description="factor between rates")
    bisect_steps: int = Field(
        2, ge=0, le=20, description="bisection steps between the last pass and first miss"
    )
    step_seconds: float = Field(
        30.0, gt=0, le=LONGEST_STEP_S, allow_inf_nan=False, description="measured seconds per load step"
    )
    warmup_seconds: float = Field(
        5.0, ge=0, le=LONGEST_STEP_S, allow_inf_nan=False, description="unmeasured seconds before each step"
    )
    arrival: Literal["poisson", "constant"] = Field("poisson", description="request arrivals (seeded)")
    max_step_seconds: float | None = Field(
        None,
        gt=0,
        le=LONGEST_STEP_S,
        allow_inf_nan=False,
        description="most measured seconds at one rate: an undecided step is measured longer up to this "
        "(default 4 x step_seconds); still undecided, it does not count as passing",
    )
    confirm_goodput: bool = Field(
        True,
        description="measure the goodput's rate again on fresh prompts and arrivals: a rate counts as passed "
        "only when every sample at it passed, and a miss there lowers the goodput to the next rate that "
        "holds (near saturation one arrival sample passes where another misses)",
    )

    @property
    def step_cap_seconds(self) -> float:
        return self.max_step_seconds if self.max_step_seconds is not None else 4 * self.step_seconds

    @model_validator(mode="after")
    def _cap_holds_a_step(self) -> Self:
        if self.max_step_seconds is not None and self.max_step_seconds < self.step_seconds:
            raise ValueError(
                f"max_step_seconds {self.max_step_seconds:g} is below step_seconds {self.step_seconds:g}: "
                "the cap on one rate's measuring must hold its first step; raise max_step_seconds"
            )
        return self

    @model_validator(mode="after")
    def _rates_ordered(self) -> Self:
        if self.max_rate < self.start_rate:
            raise ValueError(
                f"max_rate {self.max_rate:g} is below start_rate {self.start_rate:g}: no rate could be "
                "tried; raise max_rate or lower start_rate"
            )
        if self.rate_cap is not None and self.rate_cap < self.max_rate:
            raise ValueError(
                f"rate_cap {self.rate_cap:g} is below max_rate {self.max_rate:g}: the planned ladder would "
                "pass the cap; raise rate_cap or lower max_rate"
            )
        return self

    @property
    def ceiling(self) -> float:
        """The highest rate a search may measure."""
        return self.rate_cap if self.rate_cap is not None else HIGHEST_RATE

    def at_one_rate(self, rate: float) -> LoadSearch:
        """The same steps, measured at `rate` alone (a claim checked, a sentinel measured again)."""
        return self.model_copy(
            update={
                "start_rate": rate,
                "max_rate": rate,
                "rate_cap": rate,
                "bisect_steps": 0,
                "confirm_goodput": False,
            }
        )


class Budget(DocumentModel):
    trials: int = Field(12, ge=1, description="most configs measured")
    wall_minutes: float = Field(
        60.0, gt=0, le=LONGEST_SWEEP_MINUTES, description="stop starting trials after this long"
    )


class Envelope(DocumentModel):
    """What the deployment accepts to give up, in requests served, for a faster config."""

    max_model_len: int | None = Field(
        None,
        gt=0,
        description="the shortest max_model_len the winner may have: requests longer than this (prompt + "
        "output) are rejected by vLLM; required when the space tries values below the base profile's",
    )


class TrialSettings(DocumentModel):
    """Settings only trial engines run with, to make trials cheap; best.yaml keeps the base profile's."""

    enforce_eager: bool | None = Field(
        None,
        description="run trial engines eager (a CPU engine starts in ~40 s instead of ~2 min); best.yaml "
        "keeps the base profile's setting, and the validation step measures the winner that way",
    )
    skip_warmup: bool = Field(False, description="trial engines skip the base profile's warm-up prefixes")

    def applied(self, profile: EngineProfile) -> EngineProfile:
        update: dict[str, Any] = {}
        if self.enforce_eager is not None:
            update["enforce_eager"] = self.enforce_eager
        if self.skip_warmup:
            update["warmup"] = []
        return profile.model_copy(update=update)

    def speed_changes(self, deployed: EngineProfile) -> list[str]:
        """Trial settings that make a trial engine run at another speed than the deployed one."""
        if self.enforce_eager is None or self.enforce_eager == deployed.enforce_eager:
            return []
        mode = {True: "eager", False: "compiled"}
        return [
            f"enforce_eager: trials ran {mode[self.enforce_eager]}, best.yaml deploys "
            f"{mode[deployed.enforce_eager]}"
        ]


class Validation(DocumentModel):
    """After the search: the winner as deployed, the base profile and vLLM's defaults on held-out load."""

    enabled: bool = Field(True, description="measure the winner again on load the search did not see")
    seed: int | None = Field(
        None, ge=0, lt=2**32, description="seed of the held-out load (default: the spec's seed + 1000)"
    )
    workload: WorkloadSpec | None = Field(
        None, description="a further workload to validate on, e.g. a replay of the user's own prompts"
    )
    repeats: int = Field(
        2, ge=1, le=10, description="goodput searches per config and load (intervals from 2)"
    )
    candidates: int = Field(
        3, ge=1, le=20, description="most search configs validated, best first, to find one that holds"
    )
    base_profile: bool = Field(True, description="measure the base profile as the user wrote it")
    vllm_defaults: bool = Field(
        True, description="measure `vllm serve MODEL` with only what the host forces (device, dtype, memory)"
    )

    def held_out_seed(self, spec_seed: int) -> int:
        return self.seed if self.seed is not None else (spec_seed + 1000) % 2**32


class SweepSpec(DocumentModel):
    """One sweep: base profile, search space, workload, SLO, objective, budget, strategy and repeats."""

    name: str = Field(description="names the run folder: letters, digits, '.', '_' and '-'")
    base_profile: Path = Field(description="engine profile every trial starts from (relative to this file)")
    space: dict[str, list[Any] | Range] = Field(
        description="knob -> candidate values (a list or a range); each value once: 2, 2.0 and '2' are one "
        "value to the profile, so a list repeating one is refused"
    )
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    slo: Slo
    objective: Literal["goodput"] = Field("goodput", description="the highest request rate meeting the SLO")
    load: LoadSearch = Field(default_factory=LoadSearch)
    budget: Budget = Field(default_factory=Budget)
    strategy: Literal["grid", "random", "tpe"] = Field("grid", description="how configs are chosen")
    repeats: int = Field(1, ge=1, description="measurements per config (confidence intervals from 2 on)")
    cache_state: Literal["cold", "warm"] = Field("cold", description="prefix cache reset or warmed per trial")
    seed: int = Field(0, ge=0, lt=2**32, description="seed of prompts, arrivals and the search strategy")
    prune_by_kv: bool = Field(
        True, description="skip configs whose KV pool cannot hold the running requests (false: measure them)"
    )
    curve_noise: float = Field(
        0.01,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="a trace workload: of configs differing only in their KV budget, a larger pool whose "
        "predicted hit rate (the trace's curve) is less than this above a smaller one's is not measured; "
        "0 measures every pool",
    )
    quality: QualityGate = Field(
        default_factory=QualityGate, description="what an fp8 KV config must keep of 16-bit KV's outputs"
    )
    envelope: Envelope = Field(
        default_factory=Envelope, description="narrowings of the requests served that the spec accepts"
    )
    trial: TrialSettings = Field(
        default_factory=TrialSettings, description="settings for trial engines only (never in best.yaml)"
    )
    _base: EngineProfile | None = PrivateAttr(None)
    validation: Validation = Field(
        default_factory=Validation, description="the winner measured again on held-out load"
    )
    drift_check: bool = Field(
        True,
        description="measure a config that contradicts a smaller-pool neighbour again, and the first config "
        "again at the end, to say how much the host drifted and which verdicts that puts in doubt",
    )
    expose_dev_endpoints: bool = Field(
        False,
        description="let trial engines bind a base profile's non-loopback host: trials run vLLM's "
        "development endpoints (/reset_prefix_cache, /collective_rpc, /sleep), which take no API key",
    )

    @field_validator("name")
    @classmethod
    def _folder_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem:
            raise ValueError(f"{problem}, e.g. cpu-quick")
        return name

    def base(self) -> EngineProfile:
        """The base profile, read once per spec: every check, trial and output starts from the same one."""
        if self._base is None:
            self._base = load_profile(self.base_profile)
        return self._base

    @field_validator("base_profile")
    @classmethod
    def _resolve_profile(cls, value: Path, info: ValidationInfo) -> Path:
        return existing_file(value, info, "profile")

    @field_validator("space")
    @classmethod
    def _known_knobs(cls, space: dict[str, list[Any] | Range]) -> dict[str, list[Any] | Range]:
        if not space:
            raise ValueError(f"the search space is empty; give at least one knob: {', '.join(KNOBS)}")
        for knob, values in space.items():
            if knob not in KNOBS:
                near = difflib.get_close_matches(knob, KNOBS, n=1)
                hint = f"did you mean '{near[0]}'?" if near else f"knobs: {', '.join(KNOBS)}"
                raise ValueError(f"{knob!r} is not a knob a sweep can vary; {hint}")
            if isinstance(values, list) and not values:
                raise ValueError(f"{knob} has no candidate values; list at least one")
            if isinstance(values, list) and any(
                isinstance(v, float) and not math.isfinite(v) for v in values
            ):
                raise ValueError(
                    f"{knob}: {brief(values)} holds a value that is not a finite number; remove it"
                )
        sizes = [len(v.values()) if isinstance(v, Range) else len(v) for v in space.values()]
        if math.prod(sizes) > MAX_RANGE_VALUES:
            raise ValueError(
                f"the space has {math.prod(sizes):,} configs, more than the {MAX_RANGE_VALUES:,} a sweep can "
                "plan; use fewer values or coarser steps (a search measures only `budget.trials` of them)"
            )
        return space

    @model_validator(mode="after")
    def _each_value_once(self) -> Self:
        for knob, values in self.space.items():
            problem = repeated_value(knob, values) if isinstance(values, list) else None
            if problem:
                raise ValueError(f"space.{knob}: {problem}")
        return self

    @model_validator(mode="after")
    def _trials_stay_on_loopback(self) -> Self:
        host = self.base().host
        if not is_loopback(host) and not self.expose_dev_endpoints:
            raise ValueError(
                f"base_profile: binds host {host}, but sweep trials run vLLM's development endpoints "
                "(/reset_prefix_cache, /collective_rpc, /sleep) with no authentication; bind host 127.0.0.1 "
                "in the base profile, or set expose_dev_endpoints: true to accept that on this network"
            )
        return self

    @model_validator(mode="after")
    def _envelope_kept(self) -> Self:
        """A knob value that narrows the requests served is refused unless the envelope accepts it, and
        the tuning workload must fit the shortest context any config runs with."""
        base = self.base()
        served = context_tokens(base)
        floor = self.envelope.max_model_len
        for knob in ENVELOPE_KNOBS:
            values = self.candidates().get(knob, [])
            for index, value in enumerate(values):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue  # the profile check names a value of the wrong type
                narrows = served is None or value < served
                if narrows and floor is None:
                    was = f"{served:,} tokens" if served else "the model's own limit"
                    raise ValueError(
                        f"space.{knob}[{index}]: {value:g} narrows the requests the winner serves from {was} "
                        f"(the base profile) to {value:g}: vLLM would reject longer prompts + outputs. Keep "
                        f"{knob} at or above the base profile's, or accept the narrowing with "
                        f"`envelope: {{max_model_len: {value:g}}}`"
                    )
                if floor is not None and value < floor:
                    raise ValueError(
                        f"space.{knob}[{index}]: {value:g} is below envelope.max_model_len {floor:,}; remove "
                        "it or lower the envelope"
                    )
        if floor is not None and served is not None and floor > served:
            raise ValueError(
                f"envelope.max_model_len: {floor:,} is above what the base profile serves ({served:,}); "
                "the envelope is the shortest context accepted: lower it or raise the base profile's"
            )
        shortest = min(
            [v for v in self.candidates().get("max_model_len", []) if isinstance(v, int | float)]
            + ([served] if served and "max_model_len" not in self.space else []),
            default=None,
        )
        # A trace is fitted to each engine's max_model_len as it runs, and what that cuts is reported.
        if shortest is not None and self.workload.name != "trace":
            try:
                longest = longest_request(self.workload.name, self.workload.args, self.workload.max_tokens)
            except WorkloadError as exc:
                raise ValueError(f"workload.args: {exc}") from None
            if longest.tokens > shortest:
                where = "envelope.max_model_len" if floor is not None else "max_model_len"
                raise ValueError(
                    f"workload: its longest request needs ~{longest.tokens:,} tokens ({longest.how}), more "
                    f"than the {shortest:g} tokens of {where} some configs would run with: those trials "
                    "would measure rejected requests. Shorten the workload (args, max_tokens) or raise "
                    f"{where}"
                )
        return self

    def requests_to_pass(self) -> tuple[int, str]:
        """The fewest requests one step needs to pass every target with none missed, and the field that
        needs the most. ITL counts max_tokens - 1 gaps per request, the most an answer streams."""
        confidence = self.slo.confidence
        needs = [(clean_samples_to_pass(self.slo.max_error_rate, confidence), "slo.max_error_rate")]
        for name, metric, quantile, _target in self.slo.targets():
            per_request = max(self.workload.max_tokens - 1, 1) if metric == "itl" else 1
            samples = clean_samples_to_pass(1 - quantile, confidence)
            needs.append((math.ceil(samples / per_request), f"slo.{name}"))
        return max(needs, key=lambda need: need[0])

    def slowest_passable_rate(self) -> float:
        """Below this rate even the longest step (load.max_step_seconds) cannot hold the requests a pass
        needs: such a step ends undecided, and does not count as passing."""
        return self.requests_to_pass()[0] / self.load.step_cap_seconds

    @staticmethod
    def _requests_fix(field: str, needed: int, rate: float) -> str:
        seconds = math.ceil(needed / rate)
        longer = f"raise load.max_step_seconds to {seconds} or more, " if seconds <= LONGEST_STEP_S else ""
        if field == "slo.max_error_rate":
            return f"{longer}raise slo.max_error_rate, or lower slo.confidence"
        return f"{longer}target a lower quantile than {field}, or lower slo.confidence"

    def passable_rate_note(self) -> str | None:
        """A warning when the first rates of the ladder cannot pass however the engine does."""
        needed, field = self.requests_to_pass()
        slowest = needed / self.load.step_cap_seconds
        if self.load.start_rate >= slowest:
            return None
        return (
            f"rates below {slowest:.3g} req/s cannot pass: {field} at confidence {self.slo.confidence:.10g} "
            f"needs {needed:,} requests in one step, and a step lasts at most {self.load.step_cap_seconds:g} "
            f"s (load.max_step_seconds); those steps end undecided and count as missed. To judge from "
            f"load.start_rate {self.load.start_rate:g}, "
            + self._requests_fix(field, needed, self.load.start_rate)
        )

    @model_validator(mode="after")
    def _itl_is_measurable(self) -> Self:
        """An ITL target needs streamed answers of two tokens or more: one token has no gap to time."""
        itl = [name for name, metric, _q, _t in self.slo.targets() if metric == "itl"]
        if itl and self.workload.max_tokens < 2:
            raise ValueError(
                f"slo.{itl[0]}: workload.max_tokens is {self.workload.max_tokens}, so no request streams a "
                "second token and there is no inter-token gap to measure; raise workload.max_tokens to 2 or "
                f"more, or drop slo.{itl[0]}"
            )
        return self

    @model_validator(mode="after")
    def _a_step_can_pass(self) -> Self:
        """A spec whose every step, even at max_rate and measured as long as allowed, holds fewer requests
        than a pass needs would only ever report goodput 0."""
        needed, field = self.requests_to_pass()
        most = self.load.max_rate * self.load.step_cap_seconds
        if most < needed:
            raise ValueError(
                f"{field}: at confidence {self.slo.confidence:.10g} a step needs {needed:,} requests to "
                f"pass, but a step at load.max_rate {self.load.max_rate:g} req/s measured for at most "
                f"{self.load.step_cap_seconds:g} s (load.max_step_seconds) sends ~{most:,.0f}: no step could "
                f"pass. {self._requests_fix(field, needed, self.load.max_rate).capitalize()}"
            )
        return self

    @model_validator(mode="after")
    def _deployed_speed_is_measured(self) -> Self:
        deployed = self.base()
        changes = self.trial.speed_changes(deployed)
        if changes and not self.validation.enabled:
            raise ValueError(
                f"trial: {changes[0]}; only the validation step measures the winner as deployed. Enable "
                "validation, or remove trial.enforce_eager so trials run as the winner will"
            )
        return self

    @model_validator(mode="after")
    def _values_fit_the_profile(self) -> Self:
        """Each candidate value must make a valid profile (type, platform, KV arithmetic) with at least one
        combination of the other knobs; combinations that do not are pruned with the reason later."""
        base = self.base()
        candidates = self.candidates()
        # One pass over the grid, validating a combination only while it can still clear a value.
        unproven = {(knob, repr(value)) for knob, values in candidates.items() for value in values}
        first_error: dict[tuple[str, str], str] = {}
        for combo in self.grid():
            keys = {(knob, repr(value)) for knob, value in combo.items()}
            if not keys & unproven:
                continue
            error = knob_problem(base, combo)
            if error is None:
                unproven -= keys
            else:
                for key in keys:
                    first_error.setdefault(key, error)
        problems = [
            f"space.{knob}[{index}]: {brief(value)} is not usable: {first_error.get((knob, repr(value)), '')}"
            for knob, values in candidates.items()
            for index, value in enumerate(values)
            if (knob, repr(value)) in unproven
        ]
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    def candidates(self) -> dict[str, list[Any]]:
        return {k: v.values() if isinstance(v, Range) else list(v) for k, v in self.space.items()}

    def grid(self) -> list[dict[str, Any]]:
        """Every combination of candidate values, in a stable order (a repeated value counts once)."""
        return grid_configs(self.candidates())


@functools.cache
def _as_profile_value(knob: str) -> TypeAdapter[Any]:
    field = EngineProfile.model_fields[knob]
    hint: Any = Annotated[field.annotation, field]  # the field's type with its own settings and bounds
    return TypeAdapter(hint, config=ConfigDict(allow_inf_nan=False))


def repeated_value(knob: str, values: list[Any]) -> str | None:
    """Which value `values` lists more than once, as the profile reads them: 2, 2.0 and '2' are one
    max_num_seqs, '1GiB' and 1073741824 one kv_cache_memory_bytes; they would plan the same trials twice.
    A value the profile refuses is compared as written (the refusal is reported with its reason)."""
    seen: dict[Any, list[Any]] = {}
    for value in values:
        try:
            key: Any = ("read", _as_profile_value(knob).validate_python(value)) if knob in KNOBS else None
        except (ValueError, TypeError):
            key = None
        if key is None:
            key = ("written", json.dumps(value, default=repr))
        seen.setdefault(key, []).append(value)
    for (how, read), same in seen.items():
        if len(same) > 1:
            written = [brief(value) for value in same]
            times = "twice" if len(same) == 2 else f"{len(same)} times"
            forms = f" (as {', '.join(written[:-1])} and {written[-1]})" if len(set(written)) > 1 else ""
            shown = brief(read) if how == "read" else written[0]
            return f"{shown} appears {times}{forms}; list each value once"
    return None


def load_spec(path: Path) -> SweepSpec:
    return load_yaml_model(SweepSpec, path)
