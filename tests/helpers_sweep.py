"""Sweeps with scripted trials instead of engines: the specs and trial runners the sweep-loop tests share."""

from __future__ import annotations

from typing import Any

from kvtune.sweep.records import StepRecord, TrialRecord
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.trial import TrialPlan
from tests.builders import load_result
from tests.helpers import DEFAULT_PROFILE

# The sweep loop's spec (test_sweep_runner.py): three of its four configs measured on an AVX2 host.
SCRIPTED_SPEC: dict[str, Any] = {
    "name": "unit",
    "base_profile": str(DEFAULT_PROFILE),
    # 64 MiB of 32-bit KV holds 1,408 tokens: 8 requests of 700-token prompts cannot run at once.
    "space": {"kv_cache_memory_bytes": ["64MiB", "512MiB"], "max_num_seqs": [2, 8], "max_model_len": [1024]},
    "workload": {"name": "shared_prefix", "args": {"system-tokens": 600, "user-tokens": 100}, "users": 8},
    "slo": {"ttft_p99_s": 2.0},
    "envelope": {"max_model_len": 1024},
    "validation": {"enabled": False},  # tests/test_sweep_validation.py covers it
    "drift_check": False,  # tests/test_sweep_drift.py covers it: here every trial call is counted
}


class ScriptedTrials:
    """Goodput grows with max_num_seqs and the KV budget; runs recorded; Ctrl-C on the n-th call if asked."""

    def __init__(self, interrupt_on: int | None = None) -> None:
        self.calls: list[dict[str, Any]] = []
        self.kv_dtypes: list[str] = []  # what each trial's engine would run on this host
        self.interrupt_on = interrupt_on

    def __call__(self, spec: SweepSpec, plan: TrialPlan, **_: Any) -> TrialRecord:
        self.calls.append(plan.knobs)
        self.kv_dtypes.append(plan.profile.kv_cache_dtype)
        if self.interrupt_on == len(self.calls):
            raise KeyboardInterrupt
        plan.folder.mkdir(parents=True)
        budget_gain = 1.25 if plan.knobs["kv_cache_memory_bytes"] == "512MiB" else 1.0
        goodput = float(plan.knobs["max_num_seqs"]) / 4 * budget_gain
        steps = [StepRecord(rate=goodput, passed=True, result=load_result(1.0, rate=goodput)),
                 StepRecord(rate=goodput * 2, passed=False, misses=["TTFT p99 3.000 s > 2.000 s"],
                            result=load_result(3.0, rate=goodput * 1.5, preemptions=4))]  # fmt: skip
        return TrialRecord(trial=plan.number, config_id=plan.config_id, knobs=plan.knobs, status="done",
                           goodput=goodput, steps=steps)  # fmt: skip


# The outputs tests' spec (test_sweep_outputs.py, test_helm_chart.py): three configs, all measured.
OUTPUTS_SPEC: dict[str, Any] = {
    "name": "outputs",
    "base_profile": str(DEFAULT_PROFILE),
    "space": {"max_num_seqs": [2, 4, 8], "max_model_len": [1024]},
    "workload": {"args": {"system-tokens": 200, "user-tokens": 50}, "users": 4},
    "slo": {"ttft_p99_s": 2.0},
    "envelope": {"max_model_len": 1024},
    "validation": {"enabled": False},
    "drift_check": False,  # tests/test_sweep_drift.py covers it: here every trial call is counted
}


def measured(plan: TrialPlan) -> TrialRecord:
    goodput = float(plan.knobs["max_num_seqs"]) / 4
    step = StepRecord(rate=goodput, passed=True, result=load_result(1.0, rate=goodput))
    return TrialRecord(trial=plan.number, config_id=plan.config_id, knobs=plan.knobs, status="done",
                       goodput=goodput, steps=[step])  # fmt: skip
