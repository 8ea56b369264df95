"""The sweep loop with an injected trial runner: pruning, budgets, files on disk, interrupt and resume.

Real engines run the same loop in test_sweep_real.py; here a scripted runner makes every path fast.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune import cli
from kvtune.profile import load_profile
from kvtune.sweep import run_dir
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.sweeper import SweepInterrupted, run_sweep
from kvtune.sweep.trial import TrialPlan
from tests.builders import Quiet
from tests.helpers import FakeHost
from tests.helpers_sweep import SCRIPTED_SPEC as SPEC
from tests.helpers_sweep import ScriptedTrials

# The fallback host unless a test says otherwise: fp8 KV runs as 32-bit KV there.
pytestmark = [pytest.mark.usefixtures("fake_host"), pytest.mark.fake_host(cpu="avx2")]


def knobs(kv_budget: str, max_num_seqs: int) -> dict[str, Any]:
    return {"kv_cache_memory_bytes": kv_budget, "max_num_seqs": max_num_seqs, "max_model_len": 1024}


def start(tmp_path: Path, **changes: Any) -> tuple[SweepSpec, Path]:
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC | changes))
    spec = load_spec(spec_path)
    return spec, run_dir.create(tmp_path / "runs", spec, spec_path)


def exec_words(script: str) -> list[str]:
    """The words of a POSIX script's `exec` line, as `sh` splits them."""
    [line] = [line for line in script.splitlines() if line.startswith("exec ")]
    return shlex.split(line)[1:]


def flag_value(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


@pytest.mark.parametrize("host", ["avx2", "avx512"])
def test_pruned_configs_cost_no_trial_and_the_winner_is_deployable(
    host: str, tmp_path: Path, fake_host: FakeHost
) -> None:
    fake_host.use(host)
    spec, run = start(tmp_path)
    trials = ScriptedTrials()
    outcome = run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=trials)
    if host == "avx2":
        # 64 MiB of 32-bit KV with 8 running is pruned by arithmetic before any engine; three are measured.
        assert knobs("64MiB", 8) not in trials.calls
        assert len(trials.calls) == 3
        pruned = json.loads((run / run_dir.PRUNED_FILE).read_text())
        assert [p["knobs"] for p in pruned] == [knobs("64MiB", 8)]
        assert "KV pool has 1,280 usable tokens" in pruned[0]["reason"]
        assert trials.kv_dtypes == ["auto"] * 3  # the shipped fp8 profile falls back on this host
    else:
        # fp8 KV holds four times the tokens of 32-bit KV: 64 MiB now fits 8 running; all four are measured.
        assert len(trials.calls) == 4 and knobs("64MiB", 8) in trials.calls
        assert not (run / run_dir.PRUNED_FILE).exists()
        assert trials.kv_dtypes == ["fp8"] * 4
    summary = outcome.summary
    assert summary.best is not None
    assert summary.best.knobs == knobs("512MiB", 8)
    assert summary.finished
    best = load_profile(outcome.outputs["best"])  # what `kvtune up best.yaml` loads
    assert (best.max_num_seqs, int(best.kv_cache_memory_bytes or 0)) == (8, 512 * 2**20)
    assert best.kv_cache_dtype == "fp8"  # the host's fallback is not baked into the deployable file
    values = yaml.safe_load(outcome.outputs["values"].read_text())
    assert values["engine"]["maxNumSeqs"] == 8
    assert (
        values["engine"]["kvCacheDtype"] == "fp8"
        and values["monitoring"]["prometheusRule"]["ttftP99SloSeconds"]
    )
    # vllm-serve.sh runs on the host that wrote it: the KV dtype this host keeps, a note when it fell back.
    serve = outcome.outputs["serve"].read_text()
    words = exec_words(serve)
    assert words[words.index("-m") + 1] == "vllm.entrypoints.openai.api_server"
    assert flag_value(words, "--max-num-seqs") == "8"
    assert flag_value(words, "--kv-cache-dtype") == ("auto" if host == "avx2" else "fp8")
    assert ("# On this host: kv_cache_dtype fp8 -> auto" in serve) == (host == "avx2")
    html = outcome.outputs["report_html"].read_text()
    assert summary.best.config_id in html


def test_trial_budget_stops_the_search(tmp_path: Path) -> None:
    spec, run = start(tmp_path, budget={"trials": 2})
    trials = ScriptedTrials()
    outcome = run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=trials)
    assert len(trials.calls) == 2
    assert outcome.summary.stopped_because == "trial budget reached (2 configs)"


def test_interrupt_keeps_finished_trials_and_resume_runs_only_the_rest(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    with pytest.raises(SweepInterrupted) as stop:
        run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=ScriptedTrials(interrupt_on=2))
    assert not stop.value.outcome.summary.finished
    assert [r.knobs for r in run_dir.finished_trials(run)] == [knobs("64MiB", 2)]
    assert json.loads((run / run_dir.SUMMARY_FILE).read_text())["finished"] is False

    resumed = ScriptedTrials()
    outcome = run_sweep(
        run_dir.open_existing(run), run, model_path=None, progress=Quiet(), trial_runner=resumed
    )
    assert knobs("64MiB", 2) not in resumed.calls  # not measured again
    assert len(resumed.calls) == 2
    assert outcome.summary.finished and outcome.summary.trials_run == 3
    assert len(run_dir.finished_trials(run)) == 3


class RaisesOnce(ScriptedTrials):
    """The first trial raises inside the measurement (a harness fault, not the config's)."""

    def __call__(self, spec: SweepSpec, plan: TrialPlan, **kwargs: Any) -> TrialRecord:
        if not self.calls:
            self.calls.append(plan.knobs)
            raise ValueError("could not convert string to float: ''")
        return super().__call__(spec, plan, **kwargs)


def test_resume_measures_again_a_trial_that_raised_and_keeps_its_failure_file(tmp_path: Path) -> None:
    spec, run = start(tmp_path)
    first = run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=RaisesOnce())
    (failed,) = [t for t in first.summary.configs if t.status == "failed"]
    assert failed.knobs == knobs("64MiB", 2)

    resumed = ScriptedTrials()
    outcome = run_sweep(
        run_dir.open_existing(run), run, model_path=None, progress=Quiet(), trial_runner=resumed
    )
    assert resumed.calls == [knobs("64MiB", 2)]  # only the trial that raised
    assert "failed" not in {c.status for c in outcome.summary.configs}
    assert len(list(run.glob("trials/*/failure.json"))) == 1  # the fault stays on record


def test_run_folders_are_never_reused(tmp_path: Path) -> None:
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    spec = load_spec(spec_path)
    first, second = (run_dir.create(tmp_path / "runs", spec, spec_path) for _ in range(2))
    assert first != second
    # The run stands alone: its spec points at its own copy of the base profile.
    assert load_spec(first / run_dir.SPEC_FILE).base_profile == (first / run_dir.BASE_PROFILE_FILE).resolve()
    assert (tmp_path / "runs" / "unit-latest").resolve() == second.resolve()


def test_cli_refuses_a_bad_spec_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_path = tmp_path / "bad.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC | {"space": {"max_num_seq": [2, 8]}}))
    code = cli.main(["sweep", str(spec_path), "--runs-dir", str(tmp_path / "runs")])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "space: 'max_num_seq' is not a knob a sweep can vary; did you mean 'max_num_seqs'?" in err
    assert not (tmp_path / "runs").exists()


def test_dry_run_lists_trials_pruned_configs_and_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    assert cli.main(["sweep", str(spec_path), "--dry-run", "--runs-dir", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr()
    assert out.out.count("measure") == 3 and "pruned" in out.out
    assert "3 trial(s) x 1 repeat(s) to run, 1 pruned; estimated" in " ".join(out.err.split())
    assert not (tmp_path / "runs").exists()
