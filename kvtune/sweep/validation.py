"""Validation on held-out load: the search's winner as it will be deployed, against the base profile as
the user wrote it and against vLLM's defaults, each measured again on load the search never saw.

A search picks the best of many noisy measurements on one seeded workload, so its winner's figure is
biased upwards and may owe something to that seed. Here each config gets one engine, in its deployed form
(compiled where trials ran eager), and a goodput search per held-out load and repeat: the tuning workload
with another seed, and the spec's optional validation workload. The sweep claims the winner meets the SLO
at its tuned rate, so that is what is asked on the held-out seed: the winner is measured at that rate, its
repeats' samples pooled into one verdict with the SLO's confidence rule; it holds when that verdict is a
pass and it serves the validation workload at least as well as the base profile. If it does not, the
next-best search configs are validated until one holds. The baselines get goodput searches of their own,
which place them at the claimed rate too (a rate decided as missed bounds every higher one).
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtune.engine import free_port
from kvtune.files import derived_name, write_atomic
from kvtune.loadgen.results import merge_results
from kvtune.profile import EngineProfile
from kvtune.sweep.goodput import Step, verdicts
from kvtune.sweep.records import (
    CLAIM_BASIS,
    ConfigSummary,
    GoodputRatio,
    LoadStanding,
    RunSummary,
    StepRecord,
    TrialRecord,
    ValidatedConfig,
    ValidationRecord,
    ValidationRole,
    ValidationSummary,
    read_record,
    widest_ceiling,
)
from kvtune.sweep.spec import Slo, SweepSpec, WorkloadSpec
from kvtune.sweep.summary import SINGLE_RUN_TOLERANCE, ci95, explain_miss, ranked
from kvtune.sweep.trial import LoadRun, ProgressFn, TrialPlan, run_on_engine, step_record
from kvtune.sweep.validation_report import ROLE_NAMES

VALIDATION_DIR = "validation"
RECORD_FILE = "validation.json"
# On the spec's further validation workload (no tuned rate to claim), a config holds when it keeps this share
# of the base profile's goodput there: run-to-run noise on these hosts is of the order of the rest.
HOLD_SHARE = 1 - SINGLE_RUN_TOLERANCE
# vLLM's CPU build reserves gpu_memory_utilization x the memory node's total at start and refuses to start
# when less is free ("Available memory on node 0 ... is less than desired CPU memory utilization"; vLLM
# 0.32, v1/worker/cpu_worker.py). Its own error suggests 0.5; less is used when less is free.
CPU_SUGGESTED_UTILIZATION = 0.5
CPU_FREE_SHARE = 0.8  # of the free memory, so the engine's own processes still fit beside the pool

EngineRunner = Callable[..., list[TrialRecord]]


@dataclass(frozen=True)
class HeldOutLoad:
    name: str
    description: str
    workload: WorkloadSpec
    tuning_shape: bool  # the search's workload with another seed (else the spec's validation workload)


@dataclass(frozen=True)
class Subject:
    """A config to validate: its role, label, knobs and the profile it is deployed as."""

    role: ValidationRole
    label: str
    knobs: dict[str, Any]
    profile: EngineProfile
    tuned_goodput: float | None = None


def held_out_loads(spec: SweepSpec) -> list[HeldOutLoad]:
    seed = spec.validation.held_out_seed(spec.seed)
    loads = [
        HeldOutLoad(
            f"held-out seed {seed}",
            f"the search's {spec.workload.name} workload with prompt and arrival seed {seed} "
            f"(the search used {spec.seed})",
            spec.workload,
            True,
        )
    ]
    extra = spec.validation.workload
    if extra is not None:
        args = " ".join(f"{k}={v}" for k, v in extra.args.items())
        loads.append(
            HeldOutLoad(
                f"validation {extra.name}",
                f"the spec's validation workload: {extra.name} {args}, {extra.max_tokens} output tokens, "
                f"{extra.users} users",
                extra,
                False,
            )
        )
    return loads


def startable_cpu_memory_utilization(meminfo: Path = Path("/proc/meminfo")) -> float:
    """A gpu_memory_utilization vLLM's CPU build can start with on this host now (0.05 steps)."""
    fields: dict[str, int] = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        if rest.split():
            fields[name] = int(rest.split()[0])
    total, free = fields.get("MemTotal"), fields.get("MemAvailable")
    if not total or free is None:
        return CPU_SUGGESTED_UTILIZATION
    fitting = math.floor(free / total * CPU_FREE_SHARE * 20) / 20
    return max(0.05, min(CPU_SUGGESTED_UTILIZATION, fitting))


def vllm_defaults_profile(base: EngineProfile) -> EngineProfile:
    """`vllm serve MODEL` with nothing tuned: only the device, what the host forces (on CPU the base
    profile's dtype, float32 where bf16 kernels are slow, and a memory share vLLM can start with) and the
    base profile's address, credentials and warm-up prefixes, so the same clients and steps reach it."""
    cpu = base.device == "cpu"
    return EngineProfile(
        name="vllm-defaults",
        device=base.device,
        model=base.model,
        served_model_name=base.served_model_name,
        host=base.host,
        port=base.port,
        dtype=base.dtype if cpu else "auto",
        gpu_memory_utilization=startable_cpu_memory_utilization() if cpu else None,
        ready_timeout_s=base.ready_timeout_s,
        secret_env=base.secret_env,
        api_key_env=base.api_key_env,
        api_key_file=base.api_key_file,
        # Not an engine setting: what a `cache_state: warm` step re-sends first, so every config starts
        # each step from the same cache state.
        warmup=base.warmup,
    )


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def _load_runs(
    spec: SweepSpec, loads: list[HeldOutLoad], folder: Path, claimed_rate: float | None
) -> list[tuple[HeldOutLoad, LoadRun]]:
    """One run per held-out load and repeat. With `claimed_rate` (a search config), the tuning-shape load
    is measured at that rate alone; otherwise (a baseline, or the further workload) goodput is searched."""
    seed = spec.validation.held_out_seed(spec.seed)
    # The held-out load is itself one more look at the claim (the search looked twice): its goodputs are
    # measured on one sample per rate, alike for the winner and the baselines.
    held_out = spec.load.model_copy(update={"confirm_goodput": False})
    runs = []
    for load in loads:
        for repeat in range(1, spec.validation.repeats + 1):
            update: dict[str, Any] = {
                "workload": load.workload,
                "seed": (seed + repeat - 1) % 2**32,
                "load": held_out,
            }
            if claimed_rate is not None and load.tuning_shape:
                # The claim is the first step; above it the climb goes on to the config's own goodput on
                # this load, so its ratio over a baseline compares two goodputs measured alike.
                update["load"] = held_out.model_copy(
                    update={"start_rate": claimed_rate, "max_rate": claimed_rate, "bisect_steps": 0}
                )
            runs.append(
                (
                    load,
                    LoadRun(spec.model_copy(update=update), folder / f"{_slug(load.name)}-r{repeat}", repeat),
                )
            )
    return runs


def finished_records(run: Path) -> dict[tuple[str, str, int], ValidationRecord]:
    """Validation searches already on disk, by (label, load, repeat): a resumed run measures only the rest."""
    found = {}
    for path in sorted((run / VALIDATION_DIR).glob(f"*/*/{RECORD_FILE}")):
        record = read_record(ValidationRecord, path, "a validation record")
        found[(record.label, record.load, record.record.repeat)] = record
    return found


class Validator:
    """Measures subjects on the held-out loads (one engine each), keeping every record on disk."""

    def __init__(
        self,
        spec: SweepSpec,
        run: Path,
        *,
        model_path: str | None,
        progress: ProgressFn,
        runner: EngineRunner = run_on_engine,
    ) -> None:
        self.spec, self.run, self.model_path, self.say, self.runner = spec, run, model_path, progress, runner
        self.loads = held_out_loads(spec)
        self.records = finished_records(run)

    def measure(self, subject: Subject, index: int) -> list[ValidationRecord]:
        """`subject` on every held-out load and repeat; its folder is validation/<index>-<label>."""
        folder = self.run / VALIDATION_DIR / f"{index:02d}-{_slug(subject.label)}"
        runs = _load_runs(self.spec, self.loads, folder, subject.tuned_goodput)
        missing = [(load, run) for load, run in runs if self._key(subject, load, run) not in self.records]
        if missing:
            profile, _note = subject.profile.adapted_to_host()
            name = derived_name(self.spec.name, _slug(subject.label))
            profile = profile.model_copy(update={"name": name, "port": free_port(profile.host)})
            plan = TrialPlan(0, 1, subject.label, subject.knobs, profile, folder)

            def say(phase: str, line: str) -> None:
                self.say("validation", f"validation: {subject.role} {subject.label}: {line}")

            say("engine", "starting the deployed config")
            results = self.runner(
                plan, [run for _load, run in missing], model_path=self.model_path, progress=say
            )
            for (load, run), result in zip(missing, results, strict=True):
                record = ValidationRecord(
                    role=subject.role, label=subject.label, load=load.name, record=result
                )
                run.folder.mkdir(parents=True, exist_ok=True)  # an engine that never started made none
                write_atomic(run.folder / RECORD_FILE, record.model_dump_json(indent=2))
                self.records[self._key(subject, load, run)] = record
        return [self.records[self._key(subject, load, run)] for load, run in runs]

    @staticmethod
    def _key(subject: Subject, load: HeldOutLoad, run: LoadRun) -> tuple[str, str, int]:
        return (subject.label, load.name, run.repeat)


def standing(load: str, records: list[TrialRecord], settings: dict[str, Any] | None = None) -> LoadStanding:
    """Where a config stands on one held-out load; `settings` (its effective knobs) word the first miss."""
    measured = [r for r in records if r.status == "done"]
    goodputs = [r.goodput for r in measured]
    first_miss = next((s for r in measured for s in r.steps if not s.passed), None)
    failed = next((r for r in records if r.status != "done"), None)
    return LoadStanding(
        goodput_ceiling=widest_ceiling(measured),
        load=load,
        goodputs=goodputs,
        mean_goodput=statistics.fmean(goodputs) if goodputs else 0.0,
        ci95=ci95(goodputs),
        status="done" if measured else (failed.status if failed else "failed"),
        reason=failed.reason if failed else None,
        first_miss=explain_miss(first_miss, settings) if first_miss else None,
    )


def claim_step(records: list[TrialRecord], rate: float, slo: Slo) -> StepRecord | None:
    """The repeats' steps at `rate` pooled into one step, judged by the SLO's confidence rule; None when no
    repeat measured that rate."""
    steps = [s for r in records if r.status == "done" for s in r.steps if math.isclose(s.rate, rate)]
    if not steps:
        return None
    pooled = steps[0].result
    for step in steps[1:]:
        pooled = merge_results(pooled, step.result)
    return step_record(Step(rate, pooled, verdicts(pooled, slo)))


def _claim_reason(load: HeldOutLoad, tuned: float, step: StepRecord | None) -> str:
    if step is None:
        return f"{load.name}: nothing measured at its tuned {tuned:.3g} req/s"
    how = "; ".join(v.sentence("" if v.name == "error rate" else " s") for v in step.verdicts
                    if step.passed or v.decision != "pass")  # fmt: skip
    verdict = {"pass": "holds", "fail": "does not hold", "undecided": "undecided (does not hold)"}
    return (
        f"{load.name}: at its tuned {tuned:.3g} req/s, {verdict[step.decided]} on "
        f"{step.requests_due:,} requests ({how})"
    )


def _judge(subject: Subject, loads: list[HeldOutLoad], standings: list[LoadStanding],
           records: dict[str, list[TrialRecord]], base: list[LoadStanding] | None,
           slo: Slo) -> tuple[bool, str]:  # fmt: skip
    """Did a search config hold on every held-out load, and why (or why not), in figures."""
    reasons, held = [], True
    for load, got in zip(loads, standings, strict=True):
        rate = f"{got.mean_goodput:.3g} req/s"
        if got.status != "done":
            held = False
            reasons.append(f"{load.name}: {got.status} ({got.reason})")
        elif load.tuning_shape:
            tuned = subject.tuned_goodput or 0.0
            step = claim_step(records[load.name], tuned, slo)
            held &= step is not None and step.passed
            reasons.append(_claim_reason(load, tuned, step))
        else:
            base_rate = base[loads.index(load)].mean_goodput if base else None
            ok = got.mean_goodput > 0 and (base_rate is None or got.mean_goodput >= base_rate * HOLD_SHARE)
            held &= ok
            versus = f" vs the base profile's {base_rate:.3g}" if base_rate is not None else ""
            why = ""
            if not ok:
                why = ": no rate met the SLO" if got.mean_goodput == 0 else f": below {HOLD_SHARE:.0%} of it"
            reasons.append(f"{load.name}: {rate}{versus}{why}")
            if not ok and got.first_miss:
                reasons[-1] += f" ({got.first_miss.rstrip('.')})"
    return held, "; ".join(reasons)


def claim_ratio(
    rate: float, ceiling: float | None, baseline: list[TrialRecord], name: str, load: str
) -> GoodputRatio:
    """The config's goodput on held-out load (`rate`: its claimed rate held, and it climbed on from there)
    over a baseline's, with an interval from the rates each side was decided at: the baseline's goodput
    lies below its first decided miss (low end) and at or above its goodput; the config's lies at or above
    `rate` and below `ceiling`, its first decided miss above it (high end)."""
    measured = [r for r in baseline if r.status == "done"]
    goodputs = [r.goodput for r in measured]
    mean = statistics.fmean(goodputs) if goodputs else 0.0
    misses = [r.first_decided_miss for r in measured]
    low = rate / max(m for m in misses if m is not None) if misses and None not in misses else None
    high = ceiling / min(goodputs) if ceiling is not None and goodputs and min(goodputs) > 0 else None
    open_ends, shown = [], ROLE_NAMES.get(name, name)
    if low is None:
        open_ends.append(f"{shown}'s goodput is censored (no rate above it was decided to miss): no low end")
    if high is None:
        open_ends.append(
            f"{shown} met the SLO at no rate tried: no high end"
            if ceiling is not None
            else "the config's goodput is censored (no rate above it was decided to miss): no high end"
        )
    return GoodputRatio(
        baseline=name, load=load, ratio=rate / mean if mean > 0 else None, low=low, high=high,
        basis=CLAIM_BASIS, open_ends="; ".join(open_ends) or None,
    )  # fmt: skip


def ratio(config: LoadStanding, baseline: LoadStanding, name: str) -> GoodputRatio:
    """config / baseline goodput, with the conservative interval of the two 95% intervals."""
    value = config.mean_goodput / baseline.mean_goodput if baseline.mean_goodput > 0 else None
    low = high = None
    if config.ci95 is not None and baseline.ci95 is not None:
        low = config.ci95[0] / baseline.ci95[1] if baseline.ci95[1] > 0 else None
        high = config.ci95[1] / baseline.ci95[0] if baseline.ci95[0] > 0 else None
    return GoodputRatio(baseline=name, load=config.load, ratio=value, low=low, high=high)


def search_subjects(spec: SweepSpec, base: EngineProfile, summary: RunSummary) -> list[Subject]:
    """The search's best configs, best first, as best.yaml would deploy them (no trial-only settings)."""
    contenders: list[ConfigSummary] = ranked(summary.configs)[: spec.validation.candidates]
    roles: list[ValidationRole] = ["winner", *["runner-up"] * (len(contenders) - 1)]  # type: ignore[list-item]
    return [
        Subject(role, c.config_id, c.knobs, base.with_knobs(c.knobs), c.mean_goodput)
        for role, c in zip(roles, contenders, strict=True)
    ]


def run_validation(
    spec: SweepSpec,
    run: Path,
    base: EngineProfile,
    summary: RunSummary,
    *,
    model_path: str | None,
    progress: ProgressFn,
    runner: EngineRunner = run_on_engine,
) -> ValidationSummary | None:
    """Validate the search's winner (and, if it fails, the next configs) against the baselines."""
    contenders = search_subjects(spec, base, summary)
    if not contenders:
        return None
    validator = Validator(spec, run, model_path=model_path, progress=progress, runner=runner)
    loads = validator.loads
    baselines = []
    if spec.validation.base_profile:
        baselines.append(Subject("base", "base", {}, base))
    if spec.validation.vllm_defaults:
        baselines.append(Subject("vllm-defaults", "vllm-defaults", {}, vllm_defaults_profile(base)))
    # Folders are numbered in measuring order, which is the same on a resumed run.
    order = itertools.count(1)

    measured: dict[str, dict[str, list[TrialRecord]]] = {}

    def stand(subject: Subject) -> list[LoadStanding]:
        records = validator.measure(subject, next(order))
        by_load = {load.name: [r.record for r in records if r.load == load.name] for load in loads}
        measured[subject.label] = by_load
        settings = {"max_num_batched_tokens": subject.profile.effective_max_num_batched_tokens()}
        return [standing(name, found, settings) for name, found in by_load.items()]

    winner = contenders[0]
    winner_loads = stand(winner)  # first: the figure everyone waits for
    baseline_loads = {b.label: stand(b) for b in baselines}
    base_loads = baseline_loads.get("base")
    validated: list[ValidatedConfig] = []
    holding: tuple[Subject, list[LoadStanding]] | None = None
    for subject in contenders:
        got = winner_loads if subject is winner else stand(subject)
        held, why = _judge(subject, loads, got, measured[subject.label], base_loads, spec.slo)
        validated.append(_validated(subject, got, held, why))
        if held:
            holding = (subject, got)
            break
    for b in baselines:
        validated.append(_validated(b, baseline_loads[b.label], None, _baseline_verdict(
            loads, baseline_loads[b.label], (holding or (winner, []))[0].tuned_goodput or 0.0)))  # fmt: skip
    compared = holding or (winner, winner_loads)
    search_miss = _search_miss(summary, compared[0].label)
    ratios = []
    for name, their_loads in baseline_loads.items():
        for load, mine, theirs in zip(loads, compared[1], their_loads, strict=True):
            if load.tuning_shape and compared is holding:
                tuned = compared[0].tuned_goodput or 0.0
                own = [r for r in measured[compared[0].label][load.name] if r.status == "done"]
                reached = max(tuned, min((r.goodput for r in own), default=tuned))
                ceiling = widest_ceiling(own) if own else search_miss
                ratios.append(claim_ratio(reached, ceiling, measured[name][load.name], name, load.name))
            else:
                ratios.append(ratio(mine, theirs, name))
    changes = spec.trial.speed_changes(winner.profile)
    return ValidationSummary(
        loads={load.name: load.description for load in loads},
        configs=validated,
        winner_passed=bool(validated[0].passed),
        holding=holding[0].label if holding else None,
        ratios=ratios,
        settings_note=(
            f"Trial engines ran with trial-only settings ({'; '.join(changes)}); every config here was "
            "measured as deployed."
            if changes
            else None
        ),
    )


def _search_miss(summary: RunSummary, label: str) -> float | None:
    """The lowest rate the search decided `label` misses at, above its goodput (None: it never missed)."""
    config = next((c for c in summary.configs if c.config_id == label), None)
    return config.goodput_ceiling if config is not None else None


def _baseline_verdict(loads: list[HeldOutLoad], standings: list[LoadStanding], claimed: float) -> str:
    """Where a baseline stands at the claimed rate, from its own goodput search."""
    parts = []
    for load, got in zip(loads, standings, strict=True):
        if not load.tuning_shape or got.status != "done" or not claimed:
            continue
        at = "meets" if got.goodput_min >= claimed else "does not meet"
        parts.append(
            f"{load.name}: {at} the SLO at the claimed {claimed:.3g} req/s (its goodput "
            f"{', '.join(f'{g:.3g}' for g in got.goodputs)} req/s)"
        )
    return "baseline" + (f"; {'; '.join(parts)}" if parts else "")


def _validated(
    subject: Subject, loads: list[LoadStanding], passed: bool | None, verdict: str
) -> ValidatedConfig:
    return ValidatedConfig(
        role=subject.role,
        label=subject.label,
        knobs=subject.knobs,
        tuned_goodput=subject.tuned_goodput,
        loads=loads,
        passed=passed,
        verdict=verdict,
    )
