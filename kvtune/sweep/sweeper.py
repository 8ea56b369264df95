"""The sweep loop: a strategy proposes configs, arithmetic prunes, trials measure, files record everything.

Results reach disk as each trial ends, so an interrupt loses at most the trial in progress; a resumed run
replays finished trials into the strategy (same seed, same proposals) and measures only what is missing.

SIGINT and SIGTERM raise nothing: they set a stop flag (stop_request.py) that the loop reads between
trials, and end the processes of the trial in hand (processes.stopping_new_groups), whose code then
returns through its ordinary paths; the sweep raises SweepInterrupted once its files are written.
"""

from __future__ import annotations

import logging
import math
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from kvtune.engine import EngineError, free_port
from kvtune.files import derived_name, write_atomic
from kvtune.processes import stopping_new_groups
from kvtune.profile import EngineProfile
from kvtune.stop_request import StopFlag, StopRequest, requested_by_signals
from kvtune.sweep import drift, run_dir
from kvtune.sweep.devices import Slot
from kvtune.sweep.envelope import context_tokens, narrowing_sentence
from kvtune.sweep.prune import Candidate, candidates
from kvtune.sweep.records import (
    DriftCheck,
    RunSummary,
    TrialRecord,
    ValidationSummary,
    config_id,
)
from kvtune.sweep.report import write_report
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.strategies import Strategy, make_strategy
from kvtune.sweep.study import Claim, SharedStudy
from kvtune.sweep.summary import build_summary, summarize_config
from kvtune.sweep.trial import ProgressFn, QualityFn, SweepLoadError, TrialPlan, run_on_engine, run_trial
from kvtune.sweep.validation import EngineRunner, run_validation
from kvtune.sweep.winner import write_winner_files

log = logging.getLogger(__name__)

# Rough costs for `--dry-run`'s estimate, measured on the 2-core CPU machines (engine start dominates).
ENGINE_START_S = {"cpu": 65.0, "cuda": 120.0}
COMPILED_START_S = {"cpu": 150.0}  # torch.compile on CPU; CUDA graphs are in the figure above
STEP_OVERHEAD_S = 12.0  # Locust start (tokenizer load), drain, cache reset
DRIFT_DIR = "drift"  # the sentinel's second measurement and drift.json
STOP_POLL_S = 0.2  # how often a wait between trials looks for a stop


class SweepProgress(Protocol):
    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None: ...
    def phase(self, phase: str, line: str) -> None: ...
    def trial_finished(self, record: TrialRecord) -> None: ...


TrialRunner = Callable[..., TrialRecord]
# Builds the quality gate of one trial (None: the config needs none).
QualityFactory = Callable[[SweepSpec, Path, EngineProfile, str | None], QualityFn | None]


@dataclass
class SweepOutcome:
    summary: RunSummary
    run: Path
    outputs: dict[str, Path] = field(default_factory=dict)
    interrupted: bool = False


def plan(spec: SweepSpec) -> tuple[EngineProfile, list[Candidate]]:
    """The base profile and every config of the space, each pruned or not, before anything starts."""
    base = spec.base()
    return base, candidates(spec, base, spec.grid())


def _search_seconds(spec: SweepSpec) -> float:
    doublings = math.log(spec.load.max_rate / spec.load.start_rate) / math.log(spec.load.growth)
    steps = min(math.ceil(doublings) + 1, 3) + spec.load.bisect_steps + int(spec.load.confirm_goodput)
    return steps * (spec.load.warmup_seconds + spec.load.step_seconds + STEP_OVERHEAD_S)


def estimate_seconds(spec: SweepSpec, base: EngineProfile, configs: int) -> float:
    """A rough wall time for `configs` trials: engine start plus the expected load steps."""
    return configs * spec.repeats * (ENGINE_START_S.get(base.device, 120.0) + _search_seconds(spec))


def estimate_validation_seconds(spec: SweepSpec, base: EngineProfile) -> float:
    """A rough wall time for the validation step: one engine per config, as deployed, and its searches."""
    validation = spec.validation
    if not validation.enabled:
        return 0.0
    engines = 1 + validation.base_profile + validation.vllm_defaults
    loads = 1 + (validation.workload is not None)
    start = ENGINE_START_S.get(base.device, 120.0)
    # Validation engines run as deployed: compiled unless the base profile is eager.
    deployed_start = start if base.enforce_eager else COMPILED_START_S.get(base.device, start)
    return engines * (deployed_start + loads * validation.repeats * _search_seconds(spec))


def run_sweep(
    spec: SweepSpec,
    run: Path,
    *,
    model_path: str | None,
    progress: SweepProgress,
    quality: QualityFactory | None = None,
    trial_runner: TrialRunner = run_trial,
    engine_runner: EngineRunner = run_on_engine,
    clock: Callable[[], float] = time.monotonic,
    clock_sleep: Callable[[float], None] = time.sleep,
    study: SharedStudy | None = None,
    measure: bool = True,
    slot: Slot | None = None,
    validate: bool = True,
    share_note: str | None = None,
    stop: StopFlag | None = None,
) -> SweepOutcome:
    """Run (or resume) the sweep into `run`; a stop (or KeyboardInterrupt) is recorded, then raised as
    SweepInterrupted.

    STOP: read between trials, and its setting ends the trial in hand's processes; without one, SIGINT and
    SIGTERM set the sweep's own while it runs (in the main thread).

    With a STUDY, configs are claimed through it: other workers' configs are neither measured again here
    nor left out of the report, `budget.trials` counts the whole study, and the winner is validated once,
    by the first worker to find the search finished. MEASURE false (`--collect`) measures no config: the
    study's records make the report. SLOT: the devices this worker's trial engines run on (`--parallel`);
    VALIDATE false leaves validation to whoever collects; SHARE_NOTE says how trials shared the host."""
    with nullcontext(stop) if stop is not None else requested_by_signals() as asked:
        return _run_sweep(
            spec, run, model_path=model_path, progress=progress, quality=quality, trial_runner=trial_runner,
            engine_runner=engine_runner, clock=clock, clock_sleep=clock_sleep, study=study, measure=measure,
            slot=slot, validate=validate, share_note=share_note, stop=asked,
        )  # fmt: skip


def _run_sweep(
    spec: SweepSpec,
    run: Path,
    *,
    model_path: str | None,
    progress: SweepProgress,
    quality: QualityFactory | None,
    trial_runner: TrialRunner,
    engine_runner: EngineRunner,
    clock: Callable[[], float],
    clock_sleep: Callable[[float], None],
    study: SharedStudy | None,
    measure: bool,
    slot: Slot | None,
    validate: bool,
    share_note: str | None,
    stop: StopFlag,
) -> SweepOutcome:
    started = clock()
    base = spec.base()
    _adapted, host_note = base.adapted_to_host()
    if share_note:
        host_note = f"{host_note}; {share_note}" if host_note else share_note
    # A trial that raised (status "failed": a fault of the measurement, not of the config) is measured
    # again on resume; its failure.json stays in its folder. Configs vLLM refused stay refused.
    finished = {(r.config_id, r.repeat): r for r in run_dir.finished_trials(run) if r.status != "failed"}
    records: list[TrialRecord] = list(finished.values())
    pruned: list[TrialRecord] = []
    strategy = make_strategy(spec.strategy, spec.candidates(), spec.seed)
    next_number = run_dir.next_trial_number(run)
    measured = 0
    synced: set[str] = set()  # configs the strategy knows the outcome of (study: any worker's)
    excluded: dict[str, dict[str, Any]] = {}  # configs other workers are measuring
    claim: Claim | None = None
    stopped_because: str | None = None
    interrupted = False
    load_error: SweepLoadError | None = None
    try:
        while measure:
            _stop_point(stop)
            if study is not None:
                _sync(strategy, study, synced, excluded)
                measured = study.claimed_configs()
            if measured >= spec.budget.trials:
                stopped_because = f"trial budget reached ({spec.budget.trials} configs)"
                break
            if (clock() - started) / 60 > spec.budget.wall_minutes:
                stopped_because = f"wall-time budget reached ({spec.budget.wall_minutes:g} min)"
                break
            knobs = strategy.suggest()
            if knobs is None and study is not None and study.searching():
                # Another worker's config is being measured: wait for it to finish, or for its worker to
                # be found dead (then this worker measures it), so the last worker ends the search.
                _sleep_unless_stopped(study.poll_s, clock_sleep, stop)
                continue
            if knobs is None:
                break
            candidate = candidates(spec, base, [knobs])[0]
            if candidate.skipped(spec.prune_by_kv) and candidate.pruned:
                pruned.append(_pruned_record(knobs, candidate.pruned))
                run_dir.save_pruned(run, pruned)
                strategy.observe(knobs, None)
                continue
            if study is not None:
                claim = study.claim(knobs)
                if claim is None:  # another worker measures it, or has
                    continue
            measured += 1
            config_records = []
            beating = study.heartbeat(claim) if study is not None and claim is not None else nullcontext()
            with beating:
                config_records = _measure_config(
                    spec, run, knobs, finished, records, (next_number, measured), model_path, quality,
                    trial_runner, progress, stop, slot=slot,
                    worker=study.worker.name if study is not None else None,
                )  # fmt: skip
            next_number += sum(1 for r in config_records if r.trial >= next_number)
            standing = summarize_config(config_records)
            goodput = standing.mean_goodput if standing.eligible else None
            strategy.observe(knobs, goodput)
            synced.add(config_id(knobs))
            if study is not None and claim is not None:
                study.finish(claim, config_records, goodput)
                claim = None
    except KeyboardInterrupt:
        if study is not None and claim is not None:
            study.release(claim)  # measured again by another worker, or by this one on --join
        interrupted = True
        stopped_because = f"interrupted ({_how(stop)}); finished trials are kept"
    except SweepLoadError as exc:
        if study is not None and claim is not None:
            study.release(claim)
        load_error = exc
        stopped_because = f"the load could not run: {exc}"
    if study is not None:
        records = _study_records(study, records)
    drift_check: DriftCheck | None = None
    if not interrupted and load_error is None and spec.drift_check and study is None:
        try:
            drift_check = _check_drift(spec, run, records, model_path, quality, trial_runner, progress, stop)
        except KeyboardInterrupt:
            interrupted = True
            stopped_because = f"interrupted ({_how(stop)}) during the drift check; finished trials are kept"
        except SweepLoadError as exc:
            load_error = exc
            stopped_because = f"the load could not run: {exc}"
    trials = records + pruned
    validation_broke = False

    def summarize(validation: ValidationSummary | None = None) -> RunSummary:
        summary = build_summary(
            spec,
            trials,
            finished=not interrupted and not validation_broke,
            stopped_because=stopped_because,
            elapsed_s=clock() - started,
            host_note=host_note,
        )
        summary.envelope = _envelope_text(base, summary)
        summary.validation = validation
        summary.drift = drift_check
        return summary

    summary = summarize()
    outcome = SweepOutcome(summary, run, interrupted=interrupted)
    # The search's results reach disk before validation starts: a failed validation never costs them.
    outcome.outputs = write_outputs(spec, run, base, summary, trials, model_path)
    validating = (
        validate
        and not interrupted
        and load_error is None
        and spec.validation.enabled
        and summary.best is not None
    )
    validation_claim: Claim | None = None
    if validating and study is not None:
        # Once, by the first worker to find the search done; the others leave it to that one.
        other_searching = study.searching()
        done = study.validation()
        validation_claim = None if other_searching or done is not None else study.claim_validation()
        if done is not None:  # another worker validated: its verdict goes into this report too
            validating = False
            outcome.summary = summary = summarize(done)
            outcome.outputs = write_outputs(spec, run, base, summary, trials, model_path)
        elif validation_claim is None:
            validating = False
            outcome.summary.stopped_because = stopped_because = (
                "other workers are still measuring: the last to finish validates the winner"
                if other_searching
                else "another worker of the study validates the winner"
            )
    if validating:
        beating = (
            study.heartbeat(validation_claim)
            if study is not None and validation_claim is not None
            else nullcontext()
        )
        try:
            with beating, _stoppable(stop):
                validation = run_validation(
                    spec, run, base, summary, model_path=model_path, progress=progress.phase,
                    runner=engine_runner,
                )  # fmt: skip
            _stop_point(stop)  # its engines may have been ended part-way: no verdict to keep
        except KeyboardInterrupt:
            interrupted = True
            stopped_because = f"interrupted ({_how(stop)}) during validation; finished measurements are kept"
            validation = None
        except SweepLoadError as exc:
            load_error = exc
            stopped_because = f"the validation load could not run: {exc}"
            validation = None
        except Exception as exc:  # the search's results are on disk: say what broke, keep them
            log.exception("the validation step failed; the search's results and winner are kept")
            stopped_because = f"the validation step raised {type(exc).__name__}: {exc}"
            validation, validation_broke = None, True
        outcome.summary = summary = summarize(validation)
        outcome.interrupted = interrupted
        outcome.outputs = write_outputs(spec, run, base, summary, trials, model_path)
        if study is not None and validation_claim is not None:
            if validation is None:  # not done: `--collect` or a later worker may still validate
                study.release(validation_claim)
            else:
                study.finish_validation(validation_claim, validation)
    if interrupted:
        raise SweepInterrupted(outcome)
    if load_error is not None:
        raise load_error
    return outcome


class _StopAsked(KeyboardInterrupt):
    """Raised by the sweep itself, at a point where stopping is safe, once a stop was asked for."""


def _stop_point(stop: StopFlag) -> None:
    if stop.is_set():
        raise _StopAsked


def _how(stop: StopFlag) -> str:
    """How the stop came, for the summary's "stopped because"."""
    return stop.describe() if isinstance(stop, StopRequest) and stop.is_set() else "Ctrl-C"


def _sleep_unless_stopped(seconds: float, sleep: Callable[[float], None], stop: StopFlag) -> None:
    """SECONDS of SLEEP in short slices, over as soon as a stop is asked for."""
    left = seconds
    while left > 0 and not stop.is_set():
        sleep(min(STOP_POLL_S, left))
        left -= STOP_POLL_S


@contextmanager
def _stoppable(stop: StopFlag) -> Iterator[None]:
    """Work that starts engines or Locust: a stop ends their process groups, and whatever the work then
    raises (an engine gone, a load cut short) is the stop, not a fault of the config or the workload."""
    with stopping_new_groups(stop):
        try:
            yield
        except Exception:
            if stop.is_set():
                raise _StopAsked from None
            raise


def _run_one(
    spec: SweepSpec,
    run: Path,
    trial_plan: TrialPlan,
    model_path: str | None,
    quality: QualityFactory | None,
    trial_runner: TrialRunner,
    progress: SweepProgress,
    stop: StopFlag,
) -> TrialRecord:
    """One trial; an unexpected error in it fails this trial with its reason (the traceback goes to the
    trial folder's error.log) and the sweep goes on. A stop, Ctrl-C and a workload that cannot run still
    stop it; a trial that a stop cut short (anything but done) is no result, and is not kept."""
    with _stoppable(stop):
        record = _trial_record(spec, run, trial_plan, model_path, quality, trial_runner, progress, stop)
    if stop.is_set() and record.status != "done":
        raise _StopAsked  # its engine was ended under it: "did not start" says nothing of the config
    return record


def _trial_record(
    spec: SweepSpec,
    run: Path,
    trial_plan: TrialPlan,
    model_path: str | None,
    quality: QualityFactory | None,
    trial_runner: TrialRunner,
    progress: SweepProgress,
    stop: StopFlag,
) -> TrialRecord:
    try:
        try:
            gate = quality(spec, run, trial_plan.profile, model_path) if quality else None
        except EngineError as exc:
            # The gate's reference is this config at 16-bit KV: what stops it is vLLM refusing the config.
            reason = f"the quality gate's 16-bit reference engine did not start: {exc}"
            return _unmeasured(trial_plan, "infeasible", reason)
        return trial_runner(spec, trial_plan, model_path=model_path, quality=gate, progress=progress.phase)
    except (KeyboardInterrupt, SweepLoadError):
        raise
    except Exception as exc:  # recorded with its traceback; the next config may still run
        if stop.is_set():
            raise  # what ending its processes caused: _stoppable makes it the stop
        trial_plan.folder.mkdir(parents=True, exist_ok=True)
        (trial_plan.folder / "error.log").write_text(traceback.format_exc())
        log.error("trial %d failed: %s: %s (traceback in %s)", trial_plan.number,
                  type(exc).__name__, exc, trial_plan.folder / "error.log")  # fmt: skip
        return _unmeasured(trial_plan, "failed", f"the trial raised {type(exc).__name__}: {exc}")


def _measure_config(
    spec: SweepSpec,
    run: Path,
    knobs: dict[str, Any],
    finished: dict[tuple[str, int], TrialRecord],
    records: list[TrialRecord],
    numbers: tuple[int, int],
    model_path: str | None,
    quality: QualityFactory | None,
    trial_runner: TrialRunner,
    progress: SweepProgress,
    stop: StopFlag,
    *,
    worker: str | None,
    slot: Slot | None,
) -> list[TrialRecord]:
    """One config's repeats (those finished before a resume are reused), each saved as it ends; `records`
    gains the new ones. NUMBERS: the next trial's number, and the config's place in the search (shown)."""
    next_number, shown = numbers
    config_records: list[TrialRecord] = []
    for repeat in range(1, spec.repeats + 1):
        record = finished.get((config_id(knobs), repeat))
        if record is None:
            _stop_point(stop)
            trial_plan = _plan_trial(spec, run, next_number, repeat, knobs, slot)
            progress.trial_started(shown, planned_trials(spec), trial_plan)
            record = _run_one(spec, run, trial_plan, model_path, quality, trial_runner, progress, stop)
            if worker is not None:  # one of a study's workers: who measured it, and on what
                placed = {"worker": worker, "devices": slot.describe() if slot is not None else None}
                record = record.model_copy(update=placed)
            run_dir.save_trial(trial_plan.folder, record)
            records.append(record)
            progress.trial_finished(record)
            next_number += 1
        config_records.append(record)
        if record.status != "done":
            break  # a config that cannot start or crashed will not do better on a rerun
    return config_records


def _sync(
    strategy: Strategy, study: SharedStudy, synced: set[str], excluded: dict[str, dict[str, Any]]
) -> None:
    """The strategy told what other workers measured, kept off what they are measuring, and given back a
    config whose worker died before measuring it."""
    holding: set[str] = set()
    for knobs, goodput, done in study.observed():
        key = config_id(knobs)
        holding.add(key)
        if key in synced:
            continue
        if done:
            strategy.observe(knobs, goodput)
            synced.add(key)
            excluded.pop(key, None)
        elif key not in excluded:
            strategy.exclude(knobs)
            excluded[key] = knobs
    for key in [key for key in excluded if key not in holding]:
        strategy.release(excluded.pop(key))


def _study_records(study: SharedStudy, own: list[TrialRecord]) -> list[TrialRecord]:
    """Every worker's measured records, with this worker's unfinished config's (if any) after them."""
    shared = study.records()
    keys = {(r.config_id, r.repeat, r.worker) for r in shared}
    return shared + [r for r in own if (r.config_id, r.repeat, r.worker) not in keys]


def _check_drift(
    spec: SweepSpec,
    run: Path,
    records: list[TrialRecord],
    model_path: str | None,
    quality: QualityFactory | None,
    trial_runner: TrialRunner,
    progress: SweepProgress,
    stop: StopFlag,
) -> DriftCheck | None:
    """Measure again what contradicts a neighbour it should dominate (a further repeat of that config), then
    the sentinel (the first config measured) at its goodput step's rate; `records` gains the repeats."""
    remeasured = []
    for larger, smaller in drift.contradictions(records):
        if any(r.config_id == larger.config_id and r.repeat > larger.repeat for r in records):
            continue  # measured again already (a resumed run, or another pair)
        _stop_point(stop)
        number = run_dir.next_trial_number(run)
        trial_plan = _plan_trial(spec, run, number, larger.repeat + 1, larger.knobs)
        progress.trial_started(number, planned_trials(spec), trial_plan)
        again = _run_one(spec, run, trial_plan, model_path, quality, trial_runner, progress, stop)
        run_dir.save_trial(trial_plan.folder, again)
        records.append(again)
        progress.trial_finished(again)
        remeasured.append(
            f"{larger.config_id} scored {larger.goodput:.3g} req/s, below {smaller.config_id}'s "
            f"{smaller.goodput:.3g} with a larger KV pool and no preemptions; measured again: "
            f"{again.goodput:.3g} req/s"
        )
    measured = sorted((r for r in records if r.status == "done" and r.steps), key=lambda r: r.trial)
    if len(measured) < 2:
        return None  # one config: nothing it could have been compared with unfairly
    sentinel = measured[0]
    step = sentinel.best_step or sentinel.steps[0]
    fixed = spec.model_copy(update={"load": spec.load.at_one_rate(step.rate)})
    trial_plan = _plan_trial(spec, run, 0, 1, sentinel.knobs)
    trial_plan.folder = run / DRIFT_DIR / f"sentinel-{sentinel.config_id}"
    progress.phase(
        "drift", f"drift check: the first config, {sentinel.config_id}, again at {step.rate:.3g} req/s"
    )
    _stop_point(stop)
    again = _run_one(fixed, run, trial_plan, model_path, None, trial_runner, progress, stop)
    if again.status != "done" or not again.steps:
        return None
    result = drift.check(sentinel, again.steps[0], records, remeasured)
    (run / DRIFT_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(run / DRIFT_DIR / "drift.json", result.model_dump_json(indent=2))
    return result


def _unmeasured(trial_plan: TrialPlan, status: Literal["infeasible", "failed"], reason: str) -> TrialRecord:
    return TrialRecord(
        trial=trial_plan.number,
        config_id=trial_plan.config_id,
        knobs=trial_plan.knobs,
        repeat=trial_plan.repeat,
        status=status,
        reason=reason,
    )


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep, after everything finished was written; carries the partial outcome."""

    def __init__(self, outcome: SweepOutcome) -> None:
        super().__init__("sweep interrupted")
        self.outcome = outcome


def write_outputs(
    spec: SweepSpec,
    run: Path,
    base: EngineProfile,
    summary: RunSummary,
    trials: list[TrialRecord],
    model_path: str | None = None,
) -> dict[str, Path]:
    """The deployable winner first (best.yaml, values.yaml, vllm-serve.sh), then summary.json, then the
    report: a report that cannot be drawn never costs the config that won."""
    outputs: dict[str, Path] = {}
    if summary.best is not None:
        outputs |= write_winner_files(spec, run, base, summary, model_path)
    outputs["summary"] = run / run_dir.SUMMARY_FILE
    write_atomic(outputs["summary"], summary.model_dump_json(indent=2))
    try:
        outputs["report_md"], outputs["report_html"] = write_report(run, spec, summary, trials)
    except Exception:  # any drawing failure: the measured results and the winner are already on disk
        log.exception("the report could not be written; summary.json and the winner's files are kept")
    return outputs


def _envelope_text(base: EngineProfile, summary: RunSummary) -> str | None:
    if summary.best is None:
        return None
    deployed = base.with_knobs(summary.best.knobs)
    return narrowing_sentence(context_tokens(deployed), context_tokens(base))


def _plan_trial(
    spec: SweepSpec, run: Path, number: int, repeat: int, knobs: dict[str, Any], slot: Slot | None = None
) -> TrialPlan:
    # Trial-only settings (eager mode, no warm-up) make trials cheap; best.yaml never carries them.
    profile = spec.trial.applied(spec.base().with_knobs(knobs))
    profile, _note = profile.adapted_to_host()
    if slot is not None:  # one of several trials at once: on its own cores or GPUs
        profile = slot.placed(profile)
    profile = profile.model_copy(
        update={"name": derived_name(spec.name, f"t{number}"), "port": free_port(profile.host)}
    )
    cid = config_id(knobs)
    return TrialPlan(number, repeat, cid, knobs, profile, run_dir.trial_folder(run, number, cid, repeat))


def _pruned_record(knobs: dict[str, Any], reason: str) -> TrialRecord:
    return TrialRecord(trial=0, config_id=config_id(knobs), knobs=knobs, status="pruned", reason=reason)


def planned_trials(spec: SweepSpec) -> int:
    """Configs a sweep will measure at most: its trial budget, or the whole grid if that is smaller."""
    return min(spec.budget.trials, len(spec.grid()))


__all__ = [
    "ProgressFn",
    "SweepInterrupted",
    "SweepOutcome",
    "estimate_seconds",
    "estimate_validation_seconds",
    "plan",
    "planned_trials",
    "run_sweep",
]
