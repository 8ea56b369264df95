"""`kvtune plan`: the capacity arithmetic by hand (bound -> replicas, headroom, GPUs with TP/PP/DP), the
threshold picked from the engine's gauges at the goodput step and the first missed one, the overlay laid over
the run's values.yaml as the chart takes it, and every refusal through the real command line (exit 2, the
field named, no traceback).

Run folders are built from records in tmp_path (no engine): summary.json, best.yaml, values.yaml and the
winner's trials/NNN-<config>-rK/result.json, as a sweep writes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.cli import main as cli_main
from kvtune.config_errors import ConfigError
from kvtune.helm.values import ChartValues, chart_values
from kvtune.loadgen.results import EngineDeltas
from kvtune.observability.scaling_signal import SIGNALS
from kvtune.profile import load_profile
from kvtune.sweep import capacity, run_dir
from kvtune.sweep.capacity import choose_threshold, headroom, replicas_for
from kvtune.sweep.records import (
    ConfigSummary,
    RunSummary,
    StepRecord,
    TrialRecord,
    ValidatedConfig,
    ValidationSummary,
    config_id,
)
from kvtune.sweep.report import markdown_html
from tests.builders import load_result
from tests.helpers import REPO

TP2PP2 = REPO / "deploy" / "profiles" / "gpu-llama31-70b-a100-tp2pp2.yaml"
CPU = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
KNOBS = {"max_num_seqs": 64}
TP2PP2_PROFILE = load_profile(TP2PP2).model_copy(update=KNOBS)
TP2PP2_VALUES = chart_values(TP2PP2_PROFILE, ttft_p99_slo_seconds=2.0)
CID = config_id(KNOBS)
# The gauges' means at the goodput step (7 req/s) and the first missed step (8 req/s): running flat-ish,
# waiting from 0.2 to 4.2 (gap 95%), KV usage 0.5 to 0.6 (gap 17%).
PASS = {"mean_running": 20.0, "mean_waiting": 0.2, "mean_kv_usage": 0.5}
MISS = {"mean_running": 21.0, "mean_waiting": 4.2, "mean_kv_usage": 0.6}

# best.yaml is read as an engine profile, whose CPU checks look at the host: a made-up one, the same anywhere.
pytestmark = pytest.mark.usefixtures("fake_host")


# ---- builders -------------------------------------------------------------------------------------------


def step(
    rate: float, decision: Literal["pass", "fail"], means: Mapping[str, float | None], window_s: float = 30.0
) -> StepRecord:
    result = load_result(1.0 if decision == "pass" else 3.0, rate=rate)
    result = result.model_copy(update={"engine": EngineDeltas.model_validate(means), "window_s": window_s})
    return StepRecord(rate=rate, passed=decision == "pass", decision=decision, result=result)


def trial(
    goodput: float = 7.0,
    miss: float | None = 8.0,
    *,
    repeat: int = 1,
    passing: Mapping[str, float | None] | None = None,
    missing: Mapping[str, float | None] | None = None,
    devices: str | None = None,
) -> TrialRecord:
    steps = [step(goodput / 2, "pass", {"mean_running": 5.0, "mean_waiting": 0.0, "mean_kv_usage": 0.1})]
    steps.append(step(goodput, "pass", PASS if passing is None else passing))
    if miss is not None:
        steps.append(step(miss, "fail", MISS if missing is None else missing))
        steps.append(step(miss * 2, "fail", {"mean_running": 30.0, "mean_waiting": 50.0, "mean_kv_usage": 1}))
    return TrialRecord(trial=repeat, config_id=CID, knobs=KNOBS, repeat=repeat, status="done",
                       goodput=goodput, steps=steps, devices=devices)  # fmt: skip


def config(trials: list[TrialRecord], ci95: tuple[float, float] | None = None) -> ConfigSummary:
    goodputs = [t.goodput for t in trials]
    misses = [t.first_decided_miss for t in trials]
    ceiling = max(m for m in misses if m is not None) if None not in misses else None
    mean = sum(goodputs) / len(goodputs)
    return ConfigSummary(config_id=CID, knobs=KNOBS, goodputs=goodputs, mean_goodput=mean, ci95=ci95,
                         goodput_ceiling=ceiling, eligible=True, status="done")  # fmt: skip


def validation(claimed: float, *, passed: bool = True, holding: str | None = CID) -> ValidationSummary:
    winner = ValidatedConfig(role="winner", label=CID, knobs=KNOBS, tuned_goodput=claimed, loads=[],
                             passed=passed, verdict="held-out: at its tuned rate, holds" if passed else
                             "held-out: at its tuned 7 req/s, does not hold")  # fmt: skip
    other = ValidatedConfig(role="runner-up", label="b0b0b0b0", knobs={"max_num_seqs": 32}, tuned_goodput=5.0,
                            loads=[], passed=True, verdict="holds")  # fmt: skip
    return ValidationSummary(loads={"held-out": "the workload on other seeds"},
                             configs=[winner, other] if holding == other.label else [winner],
                             winner_passed=passed, holding=holding)  # fmt: skip


def summary(best: ConfigSummary, checked: ValidationSummary | None) -> RunSummary:
    return RunSummary(name="plan-test", strategy="grid", slo={"ttft_p99_s": 2.0}, base_profile="base.yaml",
                      configs=[best], best=best, validation=checked, finished=True, trials_run=1,
                      elapsed_s=1.0)  # fmt: skip


def make_run(
    folder: Path,
    trials: list[TrialRecord] | None = None,
    *,
    profile: Path = TP2PP2,
    ci95: tuple[float, float] | None = None,
    checked: ValidationSummary | str | None = "passed",
) -> Path:
    """A run folder as a finished, validated sweep leaves it (what `kvtune plan` reads)."""
    trials = [trial()] if trials is None else trials
    best = config(trials, ci95)
    if checked == "passed":
        checked = validation(best.mean_goodput)
    assert not isinstance(checked, str)
    run = folder / "plan-test-20260101-000000"
    (run / "trials").mkdir(parents=True)
    (run / run_dir.SUMMARY_FILE).write_text(summary(best, checked).model_dump_json(indent=2))
    for number, record in enumerate(trials, 1):
        run_dir.save_trial(run_dir.trial_folder(run, number, record.config_id, record.repeat), record)
    data = yaml.safe_load(profile.read_text()) | KNOBS
    (run / "best.yaml").write_text(yaml.safe_dump(data))
    values = chart_values(load_profile(run / "best.yaml"), ttft_p99_slo_seconds=2.0)
    (run / "values.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    return run


def plan_of(run: Path, peak: float = 40.0, **flags: Any) -> capacity.CapacityPlan:
    records = [r for r in run_dir.finished_trials(run) if r.config_id == CID]
    found = RunSummary.model_validate_json((run / "summary.json").read_text())
    return capacity.make_plan(found, load_profile(run / "best.yaml"), records, peak_rate=peak, run=str(run),
                              **flags)  # fmt: skip


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line `kvtune plan ARGV` is refused with (exit 2, never a traceback)."""
    try:
        code = cli_main(["plan", *argv])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code  # type: ignore[assignment]
    captured = capsys.readouterr()
    output = " ".join((captured.out + captured.err).split())
    assert code == 2, output
    assert "Traceback" not in output
    return output


# ---- the arithmetic, by hand ----------------------------------------------------------------------------


def test_a_bound_of_7_serves_40_req_s_with_6_replicas_and_5_percent_headroom() -> None:
    assert replicas_for(40, 7) == 6  # 5 x 7 = 35 < 40 <= 42 = 6 x 7
    assert headroom(6, 7, 40) == pytest.approx(0.05)
    assert replicas_for(42, 7) == 6 and headroom(6, 7, 42) == pytest.approx(0.0)  # exactly 6 bounds
    assert replicas_for(42.001, 7) == 7
    assert replicas_for(0.5, 7) == 1  # a rate below one replica's still takes one


@pytest.mark.parametrize(("rate", "bound", "replicas"), [(4.9, 0.7, 7), (2.1, 0.7, 3), (9.9, 3.3, 3)])
def test_a_rate_that_is_exactly_k_bounds_is_k_replicas_despite_float_error(
    rate: float, bound: float, replicas: int
) -> None:
    assert math.ceil(rate / bound) == replicas + 1  # 4.9 / 0.7 is 7.000000000000001 in floats
    assert replicas_for(rate, bound) == replicas


@settings(max_examples=300, deadline=None)
@given(
    k=st.integers(min_value=1, max_value=10_000),
    cents=st.integers(min_value=1, max_value=100_000),
)
def test_k_bounds_are_k_replicas_and_a_little_more_is_one_more(k: int, cents: int) -> None:
    bound = cents / 100  # a rate as written, two decimals
    assert replicas_for(k * bound, bound) == k
    assert replicas_for(k * bound * (1 + 1e-6), bound) == k + 1


@settings(max_examples=300, deadline=None)
@given(
    rate=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False),
    bound=st.floats(min_value=1e-3, max_value=1e4, allow_nan=False),
)
def test_replicas_are_the_fewest_that_serve_the_rate(rate: float, bound: float) -> None:
    replicas = replicas_for(rate, bound)
    assert replicas >= 1
    assert replicas * bound >= rate * (1 - 1e-9)
    assert replicas == 1 or (replicas - 1) * bound < rate


def test_tp_2_by_pp_2_is_4_gpus_a_replica(tmp_path: Path) -> None:
    plan = plan_of(make_run(tmp_path), 40)
    assert (plan.replicas, plan.devices_per_replica, plan.devices) == (6, 4, 24)  # 6 x TP 2 x PP 2 x DP 1
    assert plan.served_rate == 42 and plan.headroom == pytest.approx(0.05)
    assert "24 GPUs (6 replicas x TP 2 x PP 2 x DP 1)" in plan.devices_text()


def test_a_cpu_winner_is_planned_in_the_cores_its_trials_had(tmp_path: Path) -> None:
    run = make_run(tmp_path, [trial(devices="cores 0-1")], profile=CPU)
    plan = plan_of(run, 40)
    assert (plan.unit, plan.devices_per_replica, plan.devices) == ("core", 2, 12)
    assert "12 cores (6 replicas x 2 cores)" in plan.devices_text()


def test_repeats_lower_the_bound_to_the_95_percent_interval_low_end(tmp_path: Path) -> None:
    # Goodputs 6, 7, 8: mean 7, sd 1, t(2) = 4.303: low = 7 - 4.303 / sqrt(3) = 4.516; 40 / 4.516 = 8.86 -> 9.
    trials = [trial(6.0, repeat=1), trial(7.0, repeat=2), trial(8.0, 9.0, repeat=3)]
    low = 7 - 4.303 / math.sqrt(3)
    plan = plan_of(make_run(tmp_path, trials, ci95=(low, 7 + 4.303 / math.sqrt(3))), 40)
    assert plan.bound.claimed == 7 and plan.bound.rate == pytest.approx(4.516, abs=1e-3)
    assert plan.replicas == 9 and plan.headroom == pytest.approx(9 * low / 40 - 1)
    assert "lowered to its 95% interval's low end over 3 repeats" in plan.bound.basis


def test_min_rate_sets_the_least_replicas(tmp_path: Path) -> None:
    plan = plan_of(make_run(tmp_path), 40, min_rate=15)
    assert (plan.min_replicas, plan.replicas) == (3, 6)  # 15 / 7 = 2.1 -> 3
    assert plan_of(make_run(tmp_path / "b"), 40).min_replicas == 1


# ---- the threshold --------------------------------------------------------------------------------------


def test_the_signal_that_separates_most_is_chosen_and_split_at_the_midpoint() -> None:
    chosen = choose_threshold([trial()], "trials")
    gaps = {row.signal: row.gap for row in chosen.table}
    # waiting (4.2 - 0.2) / 4.2 = 95%; running (21 - 20) / 21 = 5%; kv_usage (0.6 - 0.5) / 0.6 = 17%.
    assert gaps == pytest.approx({"waiting": 4 / 4.2, "running": 1 / 21, "kv_usage": 0.1 / 0.6})
    assert chosen.signal == "waiting" and chosen.value == pytest.approx(2.2)
    assert (chosen.pass_rate, chosen.miss_rate, chosen.window_s) == (7.0, 8.0, 30.0)


def test_a_flat_signal_does_not_separate_and_another_is_chosen() -> None:
    flat = {"mean_running": 20.0, "mean_waiting": 3.0, "mean_kv_usage": 0.4}
    chosen = choose_threshold([trial(passing=flat, missing=flat | {"mean_kv_usage": 0.8})], "trials")
    assert [row.signal for row in chosen.table if row.gap is not None] == ["kv_usage"]
    assert chosen.signal == "kv_usage" and chosen.value == pytest.approx(0.6)


def test_equal_gaps_keep_the_signals_order() -> None:
    zero = {"mean_running": 0.0, "mean_waiting": 0.0, "mean_kv_usage": 0.0}
    chosen = choose_threshold([trial(passing=zero, missing={"mean_running": 4.0, "mean_waiting": 2.0,
                                                            "mean_kv_usage": 0.5})], "trials")  # fmt: skip
    assert {row.gap for row in chosen.table} == {1.0}  # every pass is 0: each gap is 1
    assert (chosen.signal, chosen.value) == ("waiting", 1.0)


def test_over_repeats_the_highest_pass_and_lowest_miss_are_compared() -> None:
    first = trial(passing=PASS | {"mean_waiting": 0.5}, missing=MISS | {"mean_waiting": 4.0})
    second = trial(repeat=2, passing=PASS | {"mean_waiting": 1.0}, missing=MISS | {"mean_waiting": 3.0})
    chosen = choose_threshold([first, second], "trials")
    assert (chosen.signal, chosen.value) == ("waiting", 2.0)  # (1.0 + 3.0) / 2


def test_every_sample_at_the_goodput_rate_counts_its_second_look_too() -> None:
    # The goodput's second look ran busier (waiting 3.0 there, 0.2 on the first): the threshold must sit
    # above both, so the midpoint is (3.0 + 4.2) / 2 = 3.6, not (0.2 + 4.2) / 2.
    record = trial()
    again = step(7.0, "pass", PASS | {"mean_waiting": 3.0}).model_copy(update={"sample": 2})
    record.steps.append(again)
    chosen = choose_threshold([record], "trials")
    assert chosen.signal == "waiting" and chosen.value == pytest.approx(3.6)
    # A second look that missed is no pass: the goodput drops to the rung below, and its means count.
    missed = trial()
    missed.steps.append(step(7.0, "fail", PASS | {"mean_waiting": 3.0}))
    assert choose_threshold([missed], "trials").pass_rate == 3.5


def test_the_threshold_is_written_short_yet_strictly_between_pass_and_miss() -> None:
    close = {"mean_running": 20.0, "mean_waiting": 1.0001, "mean_kv_usage": 0.5}
    chosen = choose_threshold([trial(passing=close, missing=close | {"mean_waiting": 1.0003})], "trials")
    assert chosen.signal == "waiting" and chosen.value == 1.0002  # 3 or 4 figures: 1, not above 1.0001
    apart = choose_threshold([trial(passing=PASS, missing=MISS | {"mean_waiting": 1 / 3})], "trials")
    assert apart.value == 0.267  # (0.2 + 0.333...) / 2 = 0.2667: three figures are between


def test_no_separating_signal_is_refused_saying_what_each_measured() -> None:
    same = {"mean_running": 20.0, "mean_waiting": 3.0, "mean_kv_usage": 0.5}
    with pytest.raises(ConfigError) as refusal:
        choose_threshold([trial(passing=same, missing=same | {"mean_waiting": 2.0})], "RUN/trials")
    text = str(refusal.value)
    assert text.startswith("RUN/trials: no engine signal is higher at the first missed step (8 req/s)")
    assert "waiting 3 -> 2; running 20 -> 20; kv_usage 0.5 -> 0.5" in text and "load.step_seconds" in text


def test_records_without_gauge_means_are_refused_as_an_older_kvtune() -> None:
    old = {"mean_running": None, "mean_waiting": None, "mean_kv_usage": None}
    with pytest.raises(ConfigError, match="measured by an older kvtune; sweep again"):
        choose_threshold([trial(passing=old, missing=old)], "RUN/trials")


# ---- the command and its overlay ------------------------------------------------------------------------


def test_plan_writes_the_overlay_beside_values_yaml_and_the_chart_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path)
    assert cli_main(["plan", str(run), "--peak-rate", "40", "--min-rate", "15", "--gpus-per-node", "8"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "6 replicas serve 40 req/s" in printed and "24 GPUs" in printed and "threshold 2.2" in printed
    text = (run / "values-plan.yaml").read_text()
    overlay = yaml.safe_load(text)
    assert overlay == {
        "replicas": 6,
        "autoscaling": {
            "signal": "waiting",
            "window": "30s",
            "keda": {"minReplicas": 3, "maxReplicas": 6, "threshold": 2.2},
            "hpa": {"minReplicas": 3, "maxReplicas": 6, "target": 2.2},
        },
    }
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any("Bound: 7 req/s per replica" in line for line in header)
    assert any("waiting 0.2 -> 4.2" in line for line in header)
    assert any(f"-f {run}/values.yaml -f {run}/values-plan.yaml" in line for line in header)
    # Laid over the run's values.yaml as Helm does, the chart's model takes it; autoscaling stays off.
    chart = ChartValues.model_validate(_merge(yaml.safe_load((run / "values.yaml").read_text()), overlay))
    assert chart.autoscaling.keda.threshold == 2.2 and chart.autoscaling.signal == "waiting"
    assert not chart.autoscaling.keda.enabled and not chart.autoscaling.hpa.enabled


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """OVER laid on BASE as Helm merges values files; a null drops the key (Helm drops the default)."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return {
        key: _merge(value, {}) if isinstance(value, dict) else value
        for key, value in merged.items()
        if value is not None
    }


@settings(max_examples=150, deadline=None)
@given(
    running=st.tuples(*[st.floats(min_value=0, max_value=512)] * 2),
    waiting=st.tuples(*[st.floats(min_value=0, max_value=512)] * 2),
    kv_usage=st.tuples(*[st.floats(min_value=0, max_value=1)] * 2),
)
def test_any_threshold_a_plan_derives_is_one_the_chart_takes(
    running: tuple[float, float], waiting: tuple[float, float], kv_usage: tuple[float, float]
) -> None:
    fields = {"mean_running": running, "mean_waiting": waiting, "mean_kv_usage": kv_usage}
    record = trial(passing={k: v[0] for k, v in fields.items()}, missing={k: v[1] for k, v in fields.items()})
    try:
        plan = capacity.make_plan(summary(config([record]), validation(7.0)), TP2PP2_PROFILE, [record],
                                  peak_rate=40, min_rate=3)  # fmt: skip
    except ConfigError as refusal:
        # Refused only when no signal is higher at the miss (or too close for a float between).
        assert all(not v[0] < (v[0] + v[1]) / 2 < v[1] for v in fields.values()), refusal
        return
    merged = _merge(TP2PP2_VALUES, capacity.overlay(plan))
    chart = ChartValues.model_validate(merged)
    assert (
        chart.autoscaling.keda.threshold > 0
        and chart.autoscaling.hpa.target == chart.autoscaling.keda.threshold
    )
    passing, missing = fields[SIGNALS[plan.threshold.signal].mean_field]
    assert passing <= chart.autoscaling.keda.threshold <= missing  # rounded to 3 figures, within the two


def test_plan_out_chooses_the_file(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    out = tmp_path / "prod.yaml"
    assert cli_main(["plan", str(run), "--peak-rate", "7", "--out", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["replicas"] == 1 and not (run / "values-plan.yaml").exists()


def test_the_report_lines_hold_the_figures(tmp_path: Path) -> None:
    lines = plan_of(make_run(tmp_path), 40).lines()
    assert lines[0].startswith("- **6 replicas** serve 40 req/s within the SLO (ttft_p99_s 2): 42 req/s, 5%")
    assert "| waiting (chosen) | 0.2 | 4.2 | 95% |" in lines and "| running | 20 | 21 | 5% |" in lines


# ---- refusals, through the command line -----------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf", "many"])
@pytest.mark.parametrize("flag", ["--peak-rate", "--min-rate"])
def test_a_rate_that_is_not_finite_and_above_0_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    rates = {"--peak-rate": "40", flag: value}
    output = refused(capsys, str(tmp_path), *(item for pair in rates.items() for item in pair))
    assert f"argument {flag}: " in output


def test_a_min_rate_above_the_peak_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = refused(capsys, str(make_run(tmp_path)), "--peak-rate", "10", "--min-rate", "20")
    assert "--min-rate 20 is above --peak-rate 10; give a --min-rate at most the peak" in output


def test_a_run_without_validation_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = refused(capsys, str(make_run(tmp_path, checked=None)), "--peak-rate", "40")
    assert "summary.json: the sweep ran without validation" in output
    assert "run the sweep with validation (validation.enabled: true in the spec)" in output


def test_a_winner_that_failed_validation_is_refused_naming_the_one_that_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, checked=validation(7.0, passed=False, holding="b0b0b0b0"))
    output = refused(capsys, str(run), "--peak-rate", "40")
    assert f"validation.winner_passed: the winner {CID} failed validation on held-out load" in output
    assert (
        "the next-best config that held is b0b0b0b0 (max_num_seqs=32)" in output and "sweep again" in output
    )
    alone = make_run(tmp_path / "alone", checked=validation(7.0, passed=False, holding=None))
    assert "no other config held either: sweep again" in refused(capsys, str(alone), "--peak-rate", "40")


def test_a_censored_goodput_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = refused(capsys, str(make_run(tmp_path, [trial(miss=None)])), "--peak-rate", "40")
    assert f"the winner {CID}'s goodput 7 req/s is censored" in output
    assert "remove or raise load.rate_cap in the spec and sweep again" in output


def test_a_bound_of_0_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trials = [trial(1.0, repeat=1), trial(9.0, 10.0, repeat=2)]
    output = refused(capsys, str(make_run(tmp_path, trials, ci95=(0.0, 55.8))), "--peak-rate", "40")
    assert "validated goodput bound is 0 req/s (the low end of its 95% interval over 2 repeats)" in output


def test_a_replica_larger_than_a_node_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = refused(capsys, str(make_run(tmp_path)), "--peak-rate", "40", "--gpus-per-node", "2")
    assert (
        "--gpus-per-node 2: one replica takes 4 GPUs (tensor_parallel_size 2 x pipeline_parallel_size 2"
        in (output)
    )
    cpu = make_run(tmp_path / "cpu", profile=CPU)
    assert "drop --gpus-per-node" in refused(capsys, str(cpu), "--peak-rate", "40", "--gpus-per-node", "8")


def test_a_missing_or_unfinished_run_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = refused(capsys, str(tmp_path / "nowhere"), "--peak-rate", "40")
    assert "RUN_DIR" in output and "is not a folder; pass the run folder a sweep printed" in output
    output = refused(capsys, str(tmp_path), "--peak-rate", "40")
    assert "has no summary.json" in output and "kvtune sweep --resume" in output


@pytest.mark.parametrize("damage", ["{not json", '{"name": "x"}', "[]", "\xff"])
def test_a_damaged_summary_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    run = make_run(tmp_path)
    (run / "summary.json").write_text(damage, encoding="latin-1")
    output = refused(capsys, str(run), "--peak-rate", "40")
    assert f"{run}/summary.json" in output
    assert "is not a run summary kvtune wrote" in output or "UTF-8" in output


def test_an_out_that_is_a_folder_or_cannot_be_written_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path)
    output = refused(capsys, str(run), "--peak-rate", "40", "--out", str(tmp_path))
    assert f"--out {tmp_path}: is not a regular file" in output
    output = refused(capsys, str(run), "--peak-rate", "40", "--out", str(tmp_path / "no" / "x.yaml"))
    assert "does not exist; create it or give another path" in output
    assert not (run / "values-plan.yaml").exists()


def test_a_run_whose_winner_has_no_trial_records_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path)
    for result in (run / "trials").glob("*/result.json"):
        result.unlink()
    output = refused(capsys, str(run), "--peak-rate", "40")
    assert f"{run}/trials: no search trial of the winner has both a passing step and a decided miss" in output


def test_the_sweep_report_carries_the_per_replica_capacity_or_says_why_there_is_none() -> None:
    trials = [trial()]
    lines = capacity.replica_lines(summary(config(trials), validation(7.0)), trials)
    text = "\n".join(lines)
    assert "is trusted with 7 req/s: the claimed 7 req/s held on held-out load" in text
    assert "threshold **2.2**" in text and "| waiting (chosen) | 0.2 | 4.2 | 95% |" in text
    assert "kvtune plan RUN_DIR --peak-rate R" in text
    html = markdown_html(text)
    assert "<table>" in html and "<strong>2.2</strong>" in html
    # The same run censored: the section says why no plan can be made, in the refusal's own words.
    censored = config([trial(miss=None)])
    (refused,) = capacity.replica_lines(summary(censored, validation(7.0)), [trial(miss=None)])
    assert refused.startswith("No capacity plan can be made from this run: summary.json: the winner")
    assert "censored" in refused
    # Markdown's raw HTML is escaped, not passed into the report.
    assert "<script>" not in markdown_html("a <script>alert(1)</script>")
