"""`kvtune sweep --parallel N`'s device plan: N disjoint slots of cores (vLLM's CPU build) or GPUs (CUDA), or
a refusal naming --parallel and what is there, before anything starts. GPU counts are faked here (no GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.config_errors import ConfigError
from kvtune.sweep.devices import Slot, plan_slots, share_note
from tests.helm_chart import ROOT
from tests.helpers_sweep import OUTPUTS_SPEC


def test_cpu_slots_share_the_cores_evenly_and_disjointly(make_profile: Any) -> None:
    slots = plan_slots(make_profile(device="cpu"), 2, cores=frozenset({0, 1, 2, 3, 4}))
    assert [slot.cores for slot in slots] == [frozenset({0, 1}), frozenset({2, 3})]
    placed = slots[1].placed(make_profile(device="cpu", cpu_reserved_cores=1))
    assert placed.cpu_threads_bind == "2-3" and placed.cpu_reserved_cores is None
    assert Slot.from_flag(slots[1].as_flag()) == slots[1]
    note = share_note(slots)
    assert note is not None and "cores 0-1; cores 2-3" in note and "per share of the host" in note
    assert share_note(slots[:1]) is None


def test_more_cpu_trials_than_cores_are_refused_naming_parallel(make_profile: Any) -> None:
    refused = (
        r"--parallel 3: each trial's engine needs 1 core\(s\) .* may run on 2 \(0-1\); at most --parallel 2"
    )
    with pytest.raises(ConfigError, match=refused):
        plan_slots(make_profile(device="cpu"), 3, cores=frozenset({0, 1}))


def test_a_space_varying_the_thread_placement_is_refused_with_parallel(make_profile: Any) -> None:
    with pytest.raises(
        ConfigError, match=r"--parallel 2: .* the space's cpu_reserved_cores would not be measured"
    ):
        plan_slots(
            make_profile(device="cpu"),
            2,
            knobs=("max_num_seqs", "cpu_reserved_cores"),
            cores=frozenset({0, 1}),
        )


def test_cuda_slots_are_tensor_parallel_sized_and_a_plan_needing_more_gpus_is_refused(
    make_profile: Any,
) -> None:
    profile = make_profile(
        device="cuda",
        model="meta-llama/Llama-3.1-8B-Instruct",
        tensor_parallel_size=2,
        cpu_threads_bind=None,
        cpu_reserved_cores=None,
    )
    slots = plan_slots(profile, 2, gpu_count=lambda: 4)
    assert [slot.gpus for slot in slots] == [(0, 1), (2, 3)]
    assert slots[1].placed(profile).env["CUDA_VISIBLE_DEVICES"] == "2,3"
    with pytest.raises(ConfigError, match=r"--parallel 3: each trial's engine needs 2 GPU\(s\) .* and 4 are "
                       r"visible here \(4 found by the driver\); at most --parallel 2"):  # fmt: skip
        plan_slots(profile, 3, gpu_count=lambda: 4)
    with pytest.raises(ConfigError, match=r"at most --parallel 0: use a host with more GPUs"):
        plan_slots(profile, 1, gpu_count=lambda: 1)


def _sweep(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(OUTPUTS_SPEC))
    return subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "sweep", str(spec), "--runs-dir", str(tmp_path / "runs"),
         *flags],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--parallel", "0"], "argument --parallel: 0 is below 1"),
        (["--parallel", "64"], "--parallel 64: each trial's engine needs 1 core(s)"),
    ],
)
def test_a_bad_parallel_exits_2_before_anything_starts(
    tmp_path: Path, flags: list[str], message: str
) -> None:
    (tmp_path / "runs").mkdir()
    done = _sweep(tmp_path, *flags)
    assert done.returncode == 2, done.stderr
    assert message in " ".join(done.stderr.split()), done.stderr
    assert not list((tmp_path / "runs").iterdir()), "no run folder"
