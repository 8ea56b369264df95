"""A host that drifts under a sweep is caught: a result that contradicts a neighbour it should dominate is
measured again, and the first config is measured again at the end; the report names the drift and the
verdicts it puts in doubt. Scripted trials (no engine): the host halves its speed after the first trial."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.loadgen.results import LatencySamples
from kvtune.sweep import run_dir
from kvtune.sweep.drift import contradictions
from kvtune.sweep.goodput import Step, verdicts
from kvtune.sweep.records import TrialRecord, config_id
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import TrialPlan, step_record
from tests.builders import Quiet, load_result
from tests.helpers import DEFAULT_PROFILE

SPEC: dict[str, Any] = {
    "name": "drift",
    "base_profile": str(DEFAULT_PROFILE),
    "space": {"kv_cache_memory_bytes": ["1GiB", "2GiB"], "max_num_seqs": [2]},
    "workload": {"args": {"system-tokens": 200, "user-tokens": 50}, "users": 4},
    "slo": {"ttft_p90_s": 2.0, "max_error_rate": 0.1},  # 100 requests a step: both decidable at 95%
    "validation": {"enabled": False},
}


pytestmark = [pytest.mark.usefixtures("fake_host"), pytest.mark.fake_host(cpu="avx2")]


class SlowingHost:
    """Every request takes 1.2 s to its first token at up to 2 req/s and 4 s above, until the first trial
    is over; then the host runs at half speed (2.4 s at any rate: every step misses). `slows=False`: a
    host that keeps its speed."""

    def __init__(self, slows: bool = True) -> None:
        self.calls: list[tuple[dict[str, Any], float]] = []
        self.slows = slows

    def __call__(self, spec: SweepSpec, plan: TrialPlan, **_: Any) -> TrialRecord:
        self.calls.append((plan.knobs, spec.load.start_rate))
        slow = self.slows and len(self.calls) > 1
        steps = []
        rate = spec.load.start_rate
        while True:
            ttft = 2.4 if slow else (1.2 if rate <= 2.0 else 4.0)
            result = load_result(ttft, rate=rate, requests=100)
            result.samples = LatencySamples.of([ttft] * 100, [0.05] * 400, [ttft] * 100)
            result.ttft = result.ttft.model_copy(update={"p50": ttft})
            step = Step(rate, result, verdicts(result, spec.slo))
            steps.append(step_record(step))
            if not step.passed or rate >= spec.load.max_rate:
                break
            rate = min(rate * spec.load.growth, spec.load.max_rate)
        goodput = max((s.rate for s in steps if s.passed), default=0.0)
        return TrialRecord(trial=plan.number, config_id=plan.config_id, knobs=plan.knobs, repeat=plan.repeat,
                           status="done", goodput=goodput, steps=steps)  # fmt: skip


def test_a_host_that_slows_midway_is_remeasured_and_named(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SPEC | {"load": {"start_rate": 0.5, "max_rate": 4.0, "bisect_steps": 0}}))
    spec = load_spec(path)
    run = run_dir.create(tmp_path / "runs", spec, path)
    host = SlowingHost()
    outcome = run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=host)

    small = {"kv_cache_memory_bytes": "1GiB", "max_num_seqs": 2}
    large = {"kv_cache_memory_bytes": "2GiB", "max_num_seqs": 2}
    # Trial 1 (fast host): 1 GiB reaches 2 req/s. Trial 2 (slow host): 2 GiB, the same batch limit and no
    # preemptions, reaches nothing: a contradiction, measured again (still slow). Then the sentinel, the
    # first config, once more at its goodput step's rate alone.
    assert host.calls == [(small, 0.5), (large, 0.5), (large, 0.5), (small, 2.0)]
    records = run_dir.finished_trials(run)
    assert [(r.config_id, r.repeat) for r in records] == [
        (config_id(small), 1), (config_id(large), 1), (config_id(large), 2),
    ]  # fmt: skip
    assert [(a.config_id, b.config_id) for a, b in contradictions(records[:2])] == [
        (config_id(large), config_id(small))
    ]
    drift = outcome.summary.drift
    assert drift is not None and drift.config_id == config_id(small) and drift.rate == 2.0
    assert (drift.ttft_p50_before, drift.ttft_p50_after) == (1.2, 2.4)
    assert drift.drifted and drift.drift == pytest.approx(1.0)
    assert drift.remeasured and drift.remeasured[0].startswith(f"{config_id(large)} scored 0 req/s, below")
    # The passes at 1.2 s against a 2 s target lie within a 100% drift: each is named as in doubt.
    assert any(f"{config_id(small)} at 2 req/s (TTFT p90 pass" in line for line in drift.in_doubt)
    report = (run / "report.md").read_text()
    assert "Host drift: Sentinel" in report and "the host drifted by 100% during the sweep" in report
    assert (run / "drift" / "drift.json").is_file()


def test_a_steady_host_is_said_to_be_steady(tmp_path: Path) -> None:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SPEC | {"load": {"start_rate": 0.5, "max_rate": 4.0, "bisect_steps": 0}}))
    spec = load_spec(path)
    run = run_dir.create(tmp_path / "runs", spec, path)

    host = SlowingHost(slows=False)
    outcome = run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=host)
    drift = outcome.summary.drift
    # The larger pool scored as the smaller did: no contradiction, only the sentinel measured again.
    assert len(host.calls) == 3 and host.calls[-1][1] == 2.0
    assert drift is not None and not drift.drifted and drift.drift == 0 and drift.remeasured == []
    assert "the host held steady" in (run / "report.md").read_text()
