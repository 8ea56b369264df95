"""Nothing a sweep measured is lost: a trial that raises fails alone, a report that cannot be drawn costs
no deployable file, the script it writes is valid `sh`, and a trial never opens dev endpoints off loopback.

The loop runs with an injected trial runner (fast); the real-engine sweep is in test_sweep_real.py.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from kvtune.commands.sweep import _RichProgress
from kvtune.config_errors import ConfigError
from kvtune.engine import EngineError
from kvtune.profile import load_profile
from kvtune.sweep import run_dir, sweeper
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import TrialPlan, run_trial
from tests.builders import Quiet
from tests.helpers import DEFAULT_PROFILE
from tests.helpers_sweep import OUTPUTS_SPEC as SPEC
from tests.helpers_sweep import measured


def start(tmp_path: Path, **changes: Any) -> tuple[SweepSpec, Path]:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SPEC | changes))
    spec = load_spec(path)
    return spec, run_dir.create(tmp_path / "runs", spec, path)


def test_a_trial_that_raises_fails_alone_and_the_sweep_goes_on(tmp_path: Path) -> None:
    spec, run = start(tmp_path)

    def runner(_spec: SweepSpec, plan: TrialPlan, **_: Any) -> TrialRecord:
        if plan.knobs["max_num_seqs"] == 4:
            raise RuntimeError("the load generator's host ran out of file descriptors")
        return measured(plan)

    outcome = run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=runner)
    records = {r.knobs["max_num_seqs"]: r for r in run_dir.finished_trials(run)}
    assert sorted(records) == [2, 4, 8], "every config got its turn"
    failed = records[4]
    assert failed.status == "failed"
    assert (
        failed.reason
        == "the trial raised RuntimeError: the load generator's host ran out of file descriptors"
    )
    (error_log,) = (run / "trials").glob("*/error.log")
    assert "RuntimeError" in error_log.read_text() and "Traceback" in error_log.read_text()
    assert outcome.summary.best is not None and outcome.summary.best.knobs["max_num_seqs"] == 8
    assert json.loads((run / run_dir.SUMMARY_FILE).read_text())["finished"] is True


def test_a_report_that_cannot_be_drawn_costs_no_deployable_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, run = start(tmp_path)

    def broken_report(*_args: Any) -> tuple[Path, Path]:
        raise ValueError("matplotlib could not lay out the plot")

    monkeypatch.setattr(sweeper, "write_report", broken_report)
    outcome = run_sweep(
        spec, run, model_path=None, progress=Quiet(), trial_runner=lambda _s, p, **_: measured(p)
    )
    assert set(outcome.outputs) == {"best", "values", "serve", "summary"}
    assert load_profile(run / "best.yaml").max_num_seqs == 8
    assert yaml.safe_load((run / "values.yaml").read_text())["engine"]["maxNumSeqs"] == 8
    assert json.loads((run / run_dir.SUMMARY_FILE).read_text())["best"]["knobs"]["max_num_seqs"] == 8
    assert not (run / "report.md").exists()


def test_the_written_script_is_valid_sh_naming_the_model_path(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    run_sweep(
        spec, run, model_path="/models/smol lm", progress=Quiet(), trial_runner=lambda _s, p, **_: measured(p)
    )
    script = run / "vllm-serve.sh"
    assert script.stat().st_mode & 0o111, "the script is executable"
    assert subprocess.run(["sh", "-n", str(script)], check=False).returncode == 0
    text = script.read_text()
    assert text.startswith("#!/bin/sh\n")
    assert "'/models/smol lm'" in text and "-m vllm.entrypoints.openai.api_server" in text
    assert "exec env VLLM_TARGET_DEVICE=cpu " in text and "--max-num-seqs 8" in text


def test_a_trial_off_loopback_is_refused_before_its_engine_starts(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    profile = load_profile(DEFAULT_PROFILE).model_copy(update={"host": "0.0.0.0"})  # noqa: S104
    plan = TrialPlan(1, 1, "c0ffee00", {"max_num_seqs": 2}, profile, run / "trials" / "001-c0ffee00-r1")
    with pytest.raises(ConfigError, match=r"host 0\.0\.0\.0 is not loopback"):
        run_trial(spec, plan, model_path=None)
    assert not plan.folder.exists(), "nothing was started or written"


def test_a_quality_reference_that_cannot_start_makes_the_config_infeasible(tmp_path: Path) -> None:
    spec, run = start(tmp_path)

    def gate_for(_spec: SweepSpec, _run: Path, profile: Any, _model: str | None) -> None:
        if profile.max_num_seqs == 4:
            raise EngineError("engine 'outputs-reference' exited with code 1 before it was ready: ValueError")
        return None

    run_sweep(spec, run, model_path=None, progress=Quiet(), quality=gate_for,
              trial_runner=lambda _s, p, **_: measured(p))  # fmt: skip
    records = {r.knobs["max_num_seqs"]: r for r in run_dir.finished_trials(run)}
    assert records[4].status == "infeasible"
    assert records[4].reason == (
        "the quality gate's 16-bit reference engine did not start: engine 'outputs-reference' exited with "
        "code 1 before it was ready: ValueError"
    )
    assert records[2].status == records[8].status == "done"


def test_progress_lines_show_config_ids_that_look_like_markup(tmp_path: Path) -> None:
    spec, _run = start(tmp_path)
    out = io.StringIO()
    record = TrialRecord(trial=2, config_id="b91b1e43", knobs={"max_num_seqs": 8}, status="done", goodput=0.8)
    with _RichProgress(Console(file=out, width=200), spec) as progress:
        progress.trial_finished(record)
    assert "trial 2 [b91b1e43] max_num_seqs=8: done, goodput 0.8 req/s" in out.getvalue()
