"""One trial: start an engine for a config, control its cache, search its goodput under load, stop it.

The engine is the foundation's context manager, so it is stopped whatever happens (an SLO miss, a load
failure, Ctrl-C). An engine that cannot start makes the config infeasible, with vLLM's own reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from kvtune import metrics, openai_client
from kvtune.config_errors import ConfigError
from kvtune.engine import Engine, EngineError, failure_reason
from kvtune.files import write_atomic
from kvtune.loadgen.results import LoadResult
from kvtune.loadgen.runner import LoadSpec, LoadTestError, run_load
from kvtune.profile import EngineProfile, is_loopback
from kvtune.sweep.goodput import GoodputSearch, Step, search_goodput
from kvtune.sweep.records import QualityRecord, StepRecord, TrialRecord
from kvtune.sweep.spec import SweepSpec
from kvtune.warmup import warm_up

log = logging.getLogger(__name__)

# `POST /reset_prefix_cache` exists only in vLLM's dev mode; a sweep needs it to start each step cold.
DEV_MODE_ENV = {"VLLM_SERVER_DEV_MODE": "1"}

# Reports what a trial is doing: a phase ("engine", "load", "quality") and a line for the user.
ProgressFn = Callable[[str, str], None]
# The quality gate, given the running engine's profile; None when the config needs no gate.
QualityFn = Callable[[EngineProfile], QualityRecord | None]


@dataclass
class TrialPlan:
    """What one trial runs: which config, as which profile, where its files go."""

    number: int
    repeat: int
    config_id: str
    knobs: dict[str, Any]
    profile: EngineProfile
    folder: Path


def reset_prefix_cache(client: httpx.Client, url: str) -> None:
    response = client.post(f"{url}/reset_prefix_cache")
    if response.status_code != 200:
        raise EngineError(
            f"POST {url}/reset_prefix_cache answered {response.status_code}: the engine needs "
            "VLLM_SERVER_DEV_MODE=1 for a sweep to control its cache"
        )


@dataclass(frozen=True)
class LoadRun:
    """One goodput search on a running engine: the spec gives workload, seed, SLO and rates."""

    spec: SweepSpec
    folder: Path
    repeat: int = 1


def run_trial(
    spec: SweepSpec,
    plan: TrialPlan,
    *,
    model_path: str | None,
    quality: QualityFn | None = None,
    progress: ProgressFn | None = None,
) -> TrialRecord:
    """Measure one config; the record says done or infeasible. Ctrl-C propagates (the engine is stopped)."""
    run = LoadRun(spec, plan.folder, plan.repeat)
    return run_on_engine(plan, [run], model_path=model_path, quality=quality, progress=progress)[0]


def run_on_engine(
    plan: TrialPlan,
    loads: list[LoadRun],
    *,
    model_path: str | None,
    quality: QualityFn | None = None,
    progress: ProgressFn | None = None,
) -> list[TrialRecord]:
    """Start one engine for `plan` and run each goodput search of `loads` on it, in order: one record per
    load, all infeasible when the engine cannot start. Ctrl-C propagates (the engine is stopped)."""
    say = progress or (lambda _phase, _line: None)
    expose = all(load.spec.expose_dev_endpoints for load in loads)
    if not is_loopback(plan.profile.host) and not expose:
        # The spec refuses this too; a trial must never open unauthenticated dev endpoints by accident.
        raise ConfigError(
            f"trial engine {plan.profile.name}: host {plan.profile.host} is not loopback and vLLM's "
            "development endpoints take no API key; bind 127.0.0.1 or set expose_dev_endpoints: true"
        )
    started = time.monotonic()
    plan.folder.mkdir(parents=True, exist_ok=True)
    write_atomic(plan.folder / "profile.yaml", plan.profile.to_yaml())
    records = [
        TrialRecord(trial=plan.number, config_id=plan.config_id, knobs=plan.knobs, repeat=load.repeat,
                    status="done")
        for load in loads
    ]  # fmt: skip
    engine = Engine(plan.profile, plan.folder / "engine.log", model_path=model_path, extra_env=DEV_MODE_ENV)
    say("engine", "starting engine")
    try:
        engine.start()
        try:
            engine.wait_ready()
        except EngineError as exc:
            for record in records:
                record.status, record.reason = "infeasible", f"engine did not start: {exc}"
                record.elapsed_s = time.monotonic() - started
            return records
        engine_start_s = time.monotonic() - started
        for load, record in zip(loads, records, strict=True):
            record.engine_start_s = engine_start_s
            load_started = time.monotonic()
            load.folder.mkdir(parents=True, exist_ok=True)
            try:
                search = _search(load, plan, engine, record, quality, say)
            except (httpx.HTTPError, LoadTestError) as exc:
                if engine.is_running():
                    raise SweepLoadError(str(exc)) from exc
                # The engine died under load (e.g. out of memory): this config fails, the sweep goes on.
                reason = f"engine exited during the trial: {failure_reason(engine.log_path)}"
                for failed in records[records.index(record) :]:
                    failed.status, failed.reason = "failed", reason
                record.elapsed_s = time.monotonic() - load_started
                return records
            record.steps = [step_record(step) for step in search.steps]
            record.goodput = search.goodput
            # The first load's time includes the engine start, as a lone trial's always has.
            record.elapsed_s = time.monotonic() - (started if record is records[0] else load_started)
    finally:
        engine.stop()
    return records


def _search(
    load: LoadRun,
    plan: TrialPlan,
    engine: Engine,
    record: TrialRecord,
    quality: QualityFn | None,
    say: ProgressFn,
) -> GoodputSearch:
    with openai_client.client_for(plan.profile.api_key()) as client:
        capacity = metrics.KvCapacity.from_samples(metrics.scrape(engine.url, client))
        record.kv_capacity = capacity.__dict__ if capacity else None
        if quality is not None:
            say("quality", "quality gate: greedy outputs vs 16-bit KV")
            record.quality = quality(plan.profile)
        spec = load.spec
        return search_goodput(
            lambda rate, window, seconds, *, continues=False: _measure(
                spec, plan, load.folder, client, MeasureWindow(rate, window, seconds, continues), say
            ),
            spec.slo,
            spec.load,
            on_step=lambda step: say("load", f"load step {step.summary_line()}"),
            requests_needed=spec.requests_to_pass()[0],
        )


def step_record(step: Step) -> StepRecord:
    return StepRecord(
        rate=step.rate,
        passed=step.passed,
        decision=step.decision,
        misses=step.misses,
        verdicts=step.verdicts,
        sample=step.sample,
        result=step.result,
    )


@dataclass(frozen=True)
class MeasureWindow:
    """One measured window: its rate, how many windows came before it at that rate, its length, and whether
    it extends the window before it (an undecided step measured longer)."""

    rate: float
    index: int
    seconds: float
    continues: bool = False


# A further window at the same rate draws other prompts and arrivals: the spec's seed moved this far per
# window, far from the seeds of repeats and held-out loads (which move by 1 and 1,000).
WINDOW_SEED_STRIDE = 7919


def _measure(
    spec: SweepSpec, plan: TrialPlan, folder: Path, client: httpx.Client, window: MeasureWindow,
    say: ProgressFn,
) -> LoadResult:  # fmt: skip
    """One load window, from the controlled cache state (an extension goes on from the state its step's
    load left: resetting there would add a cold first request to every extension, and at low rates that
    one slow answer can keep a quantile undecided window after window); warm-up time is not measured."""
    rate = window.rate
    if not window.continues:
        reset_prefix_cache(client, plan.profile.url)
        if spec.cache_state == "warm":
            warm_up(plan.profile, client)
    workload = spec.workload
    key = plan.profile.api_key()
    api_key = SecretStr(key) if key else None
    load = LoadSpec(
        url=plan.profile.url,
        workload=workload.name,
        workload_args=workload.args,
        model=plan.profile.api_model_name,
        users=workload.users,
        arrival=spec.load.arrival,
        rate=rate,
        duration_s=window.seconds,
        warmup_s=spec.load.warmup_seconds,
        max_tokens=workload.max_tokens,
        ignore_eos=workload.ignore_eos,
        seed=(spec.seed + window.index * WINDOW_SEED_STRIDE) % 2**32,
        api_key=api_key,
    )
    if window.index:
        say("load", f"load step {rate:.3g} req/s undecided: measuring {window.seconds:.0f} s more")
    else:
        say("load", f"load step {rate:.3g} req/s")
    return run_load(load, log_dir=folder)


class SweepLoadError(RuntimeError):
    """The load could not run against a live engine: the spec's workload is at fault, not the config."""
