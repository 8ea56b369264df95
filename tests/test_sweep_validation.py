"""The serving envelope, trial-only settings and the validation step, with scripted trials and engines.

Real engines: tests/test_validation_real.py. Here the logic: which requests a winner serves is never narrowed
unannounced, trials run eager while best.yaml deploys compiled, the validation step measures the deployed
configs on held-out seeds, judges the winner, names the next-best that holds, and resumes without measuring
again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.config_errors import ConfigError
from kvtune.profile import EngineProfile, load_profile
from kvtune.sweep import run_dir
from kvtune.sweep.records import StepRecord, TrialRecord, config_id
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.study import SharedStudy, StoredSpec, fingerprint, open_storage
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import LoadRun, TrialPlan
from kvtune.sweep.validation import claim_ratio, startable_cpu_memory_utilization, vllm_defaults_profile
from kvtune.sweep.validation_report import ratio_text
from tests.builders import Quiet, load_result
from tests.helpers import default_profile_data

SPEC: dict[str, Any] = {
    "name": "validated",
    "space": {"max_num_seqs": [2, 4, 8]},
    "workload": {"args": {"system-tokens": 200, "user-tokens": 50}, "users": 4},
    "slo": {"ttft_p99_s": 2.0},
    "seed": 7,
    "trial": {"enforce_eager": True},
    "validation": {"repeats": 2},
}


pytestmark = [pytest.mark.usefixtures("fake_host"), pytest.mark.fake_host(cpu="avx2")]


def base_profile(folder: Path, **overrides: Any) -> Path:
    """The shipped CPU profile as deployed: compiled (enforce_eager false), 8,192-token context."""
    path = folder / "base.yaml"
    path.write_text(yaml.safe_dump(default_profile_data(enforce_eager=False, **overrides)))
    return path


def write_spec(folder: Path, **changes: Any) -> Path:
    data = SPEC | {"base_profile": str(base_profile(folder))} | changes
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start(folder: Path, **changes: Any) -> tuple[SweepSpec, Path]:
    path = write_spec(folder, **changes)
    spec = load_spec(path)
    return spec, run_dir.create(folder / "runs", spec, path)


def record(plan: TrialPlan, goodput: float, repeat: int = 1) -> TrialRecord:
    steps = [StepRecord(rate=goodput, passed=True, result=load_result(1.0, rate=goodput))] if goodput else []
    steps.append(StepRecord(rate=max(goodput, 0.1) * 2, passed=False, misses=["TTFT p99 3.000 s > 2.000 s"],
                            result=load_result(3.0, rate=goodput, preemptions=3)))  # fmt: skip
    return TrialRecord(trial=plan.number, config_id=plan.config_id, knobs=plan.knobs, repeat=repeat,
                       status="done", goodput=goodput, steps=steps)  # fmt: skip


class Trials:
    """Search goodput = max_num_seqs / 4; every trial's profile kept."""

    def __init__(self) -> None:
        self.profiles: list[EngineProfile] = []

    def __call__(self, spec: SweepSpec, plan: TrialPlan, **_: Any) -> TrialRecord:
        self.profiles.append(plan.profile)
        plan.folder.mkdir(parents=True, exist_ok=True)
        return record(plan, float(plan.knobs["max_num_seqs"]) / 4)


class Engines:
    """Validation engines: goodput by config label from `goodputs`; every call's profile and loads kept."""

    def __init__(self, goodputs: dict[str, float]) -> None:
        self.goodputs = goodputs
        self.calls: list[tuple[EngineProfile, list[LoadRun]]] = []

    def __call__(self, plan: TrialPlan, loads: list[LoadRun], **_: Any) -> list[TrialRecord]:
        self.calls.append((plan.profile, loads))
        return [record(plan, self.goodputs[plan.config_id], load.repeat) for load in loads]


def ids(spec: SweepSpec) -> dict[int, str]:
    return {seqs: config_id({"max_num_seqs": seqs}) for seqs in (2, 4, 8)}


def test_the_winner_is_validated_as_deployed_against_both_baselines(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    cid = ids(spec)
    trials = Trials()
    engines = Engines({cid[8]: 2.0, "base": 1.0, "vllm-defaults": 0.5, cid[4]: 1.0})
    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=trials, engine_runner=engines
    )

    # Trials ran eager (cheap); best.yaml and every validation engine run as deployed: compiled.
    assert all(p.enforce_eager for p in trials.profiles)
    assert load_profile(run / "best.yaml").enforce_eager is False
    assert [profile.enforce_eager for profile, _loads in engines.calls] == [False, False, False]
    # Winner first, then the base profile as written, then vLLM's defaults: nothing tuned in the last.
    winner, base, defaults = (profile for profile, _loads in engines.calls)
    assert winner.max_num_seqs == 8 and base.max_num_seqs is None
    assert (defaults.max_num_seqs, defaults.kv_cache_memory_bytes, defaults.block_size) == (None, None, None)
    assert defaults.gpu_memory_utilization is not None and defaults.max_model_len is None
    # Held-out load: the search's workload with other seeds, one search per repeat, on one engine.
    seeds = [load.spec.seed for load in engines.calls[0][1]]
    assert seeds == [1007, 1008] and spec.seed not in seeds

    validation = outcome.summary.validation
    assert validation is not None and validation.winner_passed and validation.holding == cid[8]
    assert [c.role for c in validation.configs] == ["winner", "base", "vllm-defaults"]
    ratios = {r.baseline: r for r in validation.ratios}
    assert ratios["base"].ratio == pytest.approx(2.0) and ratios["vllm-defaults"].ratio == pytest.approx(4.0)
    # The claimed 2.0 held; the base profile was decided to miss at 2.0 (its goodput is below that) and the
    # winner's search missed at 4.0: 2.0/2.0 = 1x to 4.0/1.0 = 4x. vLLM's defaults missed at 1.0: 2x-8x.
    assert [ratios["base"].low, ratios["base"].high] == pytest.approx([1.0, 4.0])
    assert [ratios["vllm-defaults"].low, ratios["vllm-defaults"].high] == pytest.approx([2.0, 8.0])
    # The winner was measured at its claimed rate alone on the held-out seed; the baselines were searched.
    (_winner, winner_loads), (_base, base_loads) = engines.calls[0], engines.calls[1]
    assert {(load.spec.load.start_rate, load.spec.load.max_rate) for load in winner_loads} == {(2.0, 2.0)}
    assert {load.spec.load.max_rate for load in base_loads} == {spec.load.max_rate}
    # The held-out load is the claim's second look: its searches measure each rate on one sample.
    assert spec.load.confirm_goodput
    assert not any(load.spec.load.confirm_goodput for _profile, loads in engines.calls for load in loads)
    base_row = next(c for c in validation.configs if c.role == "base")
    assert "does not meet the SLO at the claimed 2 req/s (its goodput 1, 1 req/s)" in base_row.verdict
    report = (run / "report.md").read_text()
    section = report.split("## Validation on held-out load", 1)[1].split("\n## ", 1)[0]
    assert "The winner held on held-out load" in section
    for row in ("search winner: " + cid[8], "base profile (as written)", "vLLM's defaults"):
        assert row in section
    assert "over base profile (as written) on held-out seed 1007: 2.00x" in section
    assert "enforce_eager: trials ran eager, best.yaml deploys compiled" in section
    assert "Validated on held-out load" in (run / "best.yaml").read_text()


def test_a_baseline_that_meets_the_slo_nowhere_still_bounds_the_ratio_from_below(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    cid = ids(spec)
    engines = Engines({cid[8]: 2.0, "base": 1.0, "vllm-defaults": 0.0})
    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=Trials(), engine_runner=engines
    )
    validation = outcome.summary.validation
    assert validation is not None and validation.winner_passed
    defaults = next(r for r in validation.ratios if r.baseline == "vllm-defaults")
    # vLLM's defaults were decided to miss at 0.2 req/s, the lowest rate measured: their goodput is below
    # it, so the claimed 2.0 is at least 10x theirs, with no upper end.
    assert defaults.ratio is None and defaults.low == pytest.approx(10.0) and defaults.high is None
    section = (run / "report.md").read_text().split("## Validation on held-out load", 1)[1]
    assert (
        "over vLLM's defaults on held-out seed 1007: vLLM's defaults met the SLO at no rate tried; at least "
        "10.00x (conservative interval 10.00x-unbounded: "
    ) in section


def test_a_winner_that_fails_validation_is_marked_and_the_next_best_that_holds_named(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    cid = ids(spec)
    # Tuned: 8 seqs 2.0 req/s, 4 seqs 1.0. Held out: the winner drops to 1.0 (< 90% of 2.0), 4 seqs holds.
    engines = Engines({cid[8]: 1.0, "base": 0.5, "vllm-defaults": 0.5, cid[4]: 1.0})
    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=Trials(), engine_runner=engines
    )
    validation = outcome.summary.validation
    assert validation is not None and not validation.winner_passed
    assert validation.holding == cid[4]
    assert [c.role for c in validation.configs] == ["winner", "runner-up", "base", "vllm-defaults"]
    verdict = validation.configs[0].verdict
    assert validation.configs[0].passed is False
    assert (
        "held-out seed 1007: at its tuned 2 req/s, does not hold on 600 requests (TTFT p99 ≥ 3.000 s"
        in verdict
    )
    header = (run / "best.yaml").read_text()
    assert "VALIDATION FAILED" in header and f"Next-best config that held: {cid[4]}" in header
    report = (run / "report.md").read_text()
    assert "The winner FAILED validation" in report and f"next-best config that held: `{cid[4]}`" in report

    # A resumed run re-measures nothing that is on disk.
    again = Engines({})
    resumed = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=Trials(), engine_runner=again
    )
    assert again.calls == [] and resumed.summary.validation == validation


def test_a_validation_workload_the_winner_cannot_serve_fails_it(tmp_path: Path) -> None:
    extra = {"name": "shared_prefix", "args": {"system-tokens": 3000, "user-tokens": 100}, "users": 2}
    spec, run = start(tmp_path, validation={"repeats": 1, "workload": extra, "candidates": 1})
    cid = ids(spec)

    class LongPromptsRejected(Engines):
        def __call__(self, plan: TrialPlan, loads: list[LoadRun], **_: Any) -> list[TrialRecord]:
            self.calls.append((plan.profile, loads))
            long = [load.spec.workload.args.get("system-tokens") == 3000 for load in loads]
            served = plan.config_id != cid[8]  # the winner rejects the long prompts, the baselines serve them
            return [record(plan, 0.0 if is_long and not served else 2.0, load.repeat)
                    for load, is_long in zip(loads, long, strict=True)]  # fmt: skip

    engines = LongPromptsRejected({})
    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=Trials(), engine_runner=engines
    )
    validation = outcome.summary.validation
    assert validation is not None and list(validation.loads) == [
        "held-out seed 1007",
        "validation shared_prefix",
    ]
    assert not validation.winner_passed and validation.holding is None
    assert "validation shared_prefix: 0 req/s vs the base profile's 2: no rate met the SLO" in (
        validation.configs[0].verdict
    )
    assert "No other validated config held either" in (run / "best.yaml").read_text()


def test_validation_can_be_turned_off_but_not_while_trials_run_at_another_speed(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"trial: enforce_eager: trials ran eager, best.yaml deploys compiled"
    ):
        load_spec(write_spec(tmp_path, validation={"enabled": False}))
    spec, run = start(tmp_path, validation={"enabled": False}, trial={})
    engines = Engines({})
    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=Trials(), engine_runner=engines
    )
    assert engines.calls == [] and outcome.summary.validation is None


# --- The serving envelope ------------------------------------------------------------------------------


def test_a_space_that_narrows_max_model_len_unacknowledged_is_refused_with_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_spec(write_spec(tmp_path, space={"max_model_len": [1024, 8192]}))
    message = str(refused.value)
    assert "space.max_model_len[0]: 1024 narrows the requests the winner serves from 8,192 tokens" in message
    assert "envelope: {max_model_len: 1024}" in message
    with pytest.raises(
        ConfigError, match=r"space.max_model_len\[0\]: 512 is below envelope.max_model_len 1,024"
    ):
        load_spec(
            write_spec(tmp_path, space={"max_model_len": [512, 1024]}, envelope={"max_model_len": 1024})
        )
    with pytest.raises(
        ConfigError, match=r"envelope.max_model_len: 9,000 is above what the base profile serves"
    ):
        load_spec(write_spec(tmp_path, envelope={"max_model_len": 9000}))


def test_a_workload_longer_than_the_envelope_is_refused_before_any_engine(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_spec(
            write_spec(
                tmp_path,
                space={"max_model_len": [1024]},
                envelope={"max_model_len": 1024},
                workload={"args": {"system-tokens": 900, "user-tokens": 100}, "max_tokens": 64},
            )
        )
    expected = (
        "workload: its longest request needs ~1,128 tokens (900 system + 100 user + 64 output + 64 for the "
        "chat template), more than the 1024 tokens of envelope.max_model_len"
    )
    assert expected in str(refused.value)


def test_an_acknowledged_narrowing_is_stated_in_best_yaml_the_report_and_the_summary(tmp_path: Path) -> None:
    spec, run = start(tmp_path, space={"max_num_seqs": [2, 8], "max_model_len": [1024]},
                      envelope={"max_model_len": 1024}, validation={"enabled": False}, trial={})  # fmt: skip
    run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=Trials())
    best = (run / "best.yaml").read_text()
    assert load_profile(run / "best.yaml").max_model_len == 1024
    sentence = (
        "This config serves requests of at most 1,024 tokens (prompt + output); the base profile serves up "
        "to 8,192"
    )
    assert sentence in " ".join(line.removeprefix("# ") for line in best.splitlines())
    assert sentence in (run / "report.md").read_text()
    assert sentence in (run / "summary.json").read_text()


# --- vLLM's defaults -----------------------------------------------------------------------------------


def test_vllm_defaults_keep_only_what_the_host_forces(tmp_path: Path) -> None:
    tuned = EngineProfile.model_validate(
        default_profile_data(max_num_seqs=4, block_size=32, max_num_batched_tokens=512, api_key_env="MY_KEY",
                             warmup=[{"text": "You are a helpful assistant."}])
    )  # fmt: skip
    defaults = vllm_defaults_profile(tuned)
    assert defaults.vllm_args() == [
        "--model", "smollm2-135m", "--served-model-name", "smollm2-135m", "--host", "127.0.0.1",
        "--port", str(tuned.port), "--dtype", "float32",
        "--gpu-memory-utilization", str(defaults.gpu_memory_utilization),
        "--enable-prefix-caching", "--kv-cache-dtype", "auto", "--shutdown-timeout", "20",
    ]  # fmt: skip
    assert defaults.api_key_env == "MY_KEY"  # the same clients reach it
    assert defaults.warmup == tuned.warmup  # a warm step starts from the same cache state
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemFree: 1 kB\nMemAvailable: 15000000 kB\n")
    assert startable_cpu_memory_utilization(meminfo) == 0.5  # vLLM's own suggestion
    meminfo.write_text("MemTotal: 16000000 kB\nMemAvailable: 6000000 kB\n")
    assert startable_cpu_memory_utilization(meminfo) == 0.3  # 80% of the 37.5% free, in 0.05 steps


def test_a_validation_step_that_raises_keeps_the_search_and_says_so(tmp_path: Path) -> None:
    spec, run = start(tmp_path)

    def broken(plan: TrialPlan, loads: list[LoadRun], **_: Any) -> list[TrialRecord]:
        raise FileNotFoundError("the load folder vanished")

    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=Trials(), engine_runner=broken
    )
    assert outcome.summary.best is not None and outcome.summary.validation is None
    assert outcome.summary.finished is False
    assert (
        outcome.summary.stopped_because
        == "the validation step raised FileNotFoundError: the load folder vanished"
    )
    assert load_profile(run / "best.yaml").max_num_seqs == 8
    assert "Stopped early: the validation step raised FileNotFoundError" in (run / "report.md").read_text()


def test_a_baseline_with_no_decided_miss_gets_no_interval_and_is_told_why() -> None:
    """The base profile passed 1.25 req/s and stayed undecided at 1.6: its goodput is 1.25 but nothing
    decided bounds it from above, so the claimed 1.6 over it is 1.28x with no interval (not for want of
    repeats)."""
    steps = [
        StepRecord(rate=1.25, passed=True, decision="pass", result=load_result(1.0, rate=1.25)),
        StepRecord(rate=1.6, passed=False, decision="undecided", result=load_result(2.0, rate=1.6)),
    ]
    base = TrialRecord(trial=1, config_id="base", knobs={}, status="done", goodput=1.25, steps=steps)
    ratio = claim_ratio(1.6, None, [base], "base", "held-out seed 1000")
    assert ratio.ratio == pytest.approx(1.28) and ratio.low is None and ratio.high is None
    assert ratio_text(ratio) == (
        "over base profile (as written) on held-out seed 1000: 1.28x (no interval); base profile (as "
        "written)'s goodput is censored (no rate above it was decided to miss): no low end; the config's "
        "goodput is censored (no rate above it was decided to miss): no high end"
    )
    # Decided to miss at 1.6 instead: its goodput lies below 1.6, so the claim is at least 1.6/1.6 = 1x.
    base.steps[1] = StepRecord(rate=1.6, passed=False, decision="fail", result=load_result(2.0, rate=1.6))
    assert claim_ratio(1.6, None, [base], "base", "held-out seed 1000").low == pytest.approx(1.0)


def test_a_study_s_winner_is_validated_once_and_every_later_report_carries_it(tmp_path: Path) -> None:
    """Two workers of one study (a journal file): the first to find the search done validates; a `--collect`
    afterwards measures nothing, validates nothing, and its report has the same verdict."""
    path = write_spec(tmp_path)
    spec = load_spec(path)
    base = (tmp_path / "base.yaml").read_text()
    storage = open_storage(str(tmp_path / "study.journal"))
    stored = StoredSpec(
        run_dir.run_spec_yaml(spec, path), base, fingerprint(spec.model_dump(mode="json"), base)
    )
    cid = ids(spec)
    engines = Engines({cid[8]: 2.0, "base": 1.0, "vllm-defaults": 0.5, cid[4]: 1.0})
    first = run_dir.create(tmp_path / "runs", spec, path)
    study = SharedStudy.create_or_join(storage, "validated", stored)
    outcome = run_sweep(
        spec,
        first,
        model_path=None,
        progress=Quiet(),
        trial_runner=Trials(),
        engine_runner=engines,
        study=study,
    )
    assert outcome.summary.validation is not None and len(engines.calls) == 3

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("measured again")

    later = run_dir.create(tmp_path / "runs", spec, path)
    again = run_sweep(
        spec, later, model_path=None, progress=Quiet(), trial_runner=never, engine_runner=never,
        study=SharedStudy.create_or_join(storage, "validated", stored), measure=False,
    )  # fmt: skip
    assert again.summary.validation == outcome.summary.validation
    assert "The winner held on held-out load" in (later / "report.md").read_text()
