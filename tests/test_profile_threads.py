"""CPU thread placement: cpu_threads_bind and cpu_reserved_cores render to vLLM's environment, are checked
against the cores this host lets kvtune run on (only where vLLM's CPU build runs), and are the only source
of VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_NUM_OF_RESERVED_CPU."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune import platform
from kvtune.config_errors import ConfigError
from kvtune.helm.values import chart_values
from kvtune.platform import CPU_COMPILE_ENV
from kvtune.profile import MANAGED_ENV, EngineProfile, load_profile
from kvtune.sweep.spec import load_spec
from tests.helpers import FakeHost, write_test_profile

BASE: dict[str, Any] = {
    "device": "cpu",
    "model": "smollm2-135m",
    "max_model_len": 8192,
    "kv_cache_memory_bytes": "1GiB",
}
HOST_CORES = frozenset({0, 1})
REAL_HOST_CPU_IDS = platform.host_cpu_ids  # before any test replaces it


# Unit tests see a 2-core AVX-512 host running vLLM's CPU build (with fp8 KV) unless a test says otherwise.
pytestmark = [
    pytest.mark.usefixtures("fake_host"),
    pytest.mark.fake_host(cpu="avx512", cores=HOST_CORES, device="cpu"),
]


def load(tmp_path: Path, **changes: Any) -> EngineProfile:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(BASE | changes))
    return load_profile(path)


def error_for(tmp_path: Path, **changes: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, **changes)
    return str(info.value)


# ---- rendering ---------------------------------------------------------------------------------------------


def test_fields_render_to_vllm_environment_everywhere(tmp_path: Path) -> None:
    profile = load(tmp_path, cpu_threads_bind="auto", cpu_reserved_cores=0)
    expected = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_USE_AOT_COMPILE": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    assert profile.engine_env() == expected
    assert profile.launch_env() == expected
    command = profile.launch_command("/models/smol")
    assert command[: len(expected) + 1] == ["env", *(f"{k}={v}" for k, v in expected.items())]
    exec_line = profile.serve_script("/models/smol").splitlines()[-1]
    assert shlex.split(exec_line)[1:] == command
    values = chart_values(profile)["engine"]
    assert values["cpuThreadsBind"] == "auto"
    assert values["cpuReservedCores"] == 0
    # Neither is a vLLM flag: argv and the serve YAML stay as they were.
    assert profile.vllm_args() == load(tmp_path).vllm_args()


@pytest.mark.parametrize("bind", ["auto", "nobind", "0", "1", "0-1", "0,1", "1,0", "0|1", "0-1|1"])
def test_bindings_vllm_reads_round_trip(tmp_path: Path, bind: str) -> None:
    # One core list per rank: two lists are two ranks (SmolLM2's 9 heads take no TP 2: two pipeline stages).
    profile = load(tmp_path, cpu_threads_bind=bind, pipeline_parallel_size=bind.count("|") + 1)
    assert profile.engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == bind
    assert f"VLLM_CPU_OMP_THREADS_BIND={bind}" in shlex.split(profile.serve_script().splitlines()[-1])
    assert EngineProfile.model_validate(yaml.safe_load(profile.to_yaml())) == profile


def test_a_single_core_given_as_a_yaml_number_is_that_core(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(BASE) + "cpu_threads_bind: 1\n")
    assert load_profile(path).engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_unset_fields_leave_vllm_its_defaults(tmp_path: Path) -> None:
    profile = load(tmp_path)
    assert profile.engine_env() == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_USE_AOT_COMPILE": "0"}
    assert "cpu_threads_bind" not in profile.to_yaml()


def test_cpu_engines_compile_through_torchs_cache_unless_the_profile_says_otherwise(tmp_path: Path) -> None:
    # vLLM's CPU build cannot load its own AOT artefacts, so kvtune turns them off; a profile's env wins.
    assert load(tmp_path).engine_env()["VLLM_USE_AOT_COMPILE"] == "0"
    profile = load(tmp_path, env={"VLLM_USE_AOT_COMPILE": "1"})
    assert profile.engine_env()["VLLM_USE_AOT_COMPILE"] == "1"
    assert "VLLM_USE_AOT_COMPILE=1" in profile.launch_command("/models/smol")


def test_every_rendered_variable_is_managed(tmp_path: Path) -> None:
    """A variable added to engine_env but not to MANAGED_ENV could be set in env too, unnoticed. The
    compile defaults are the exception by design: a profile's env may override them."""
    profile = load(tmp_path, cpu_threads_bind="auto", cpu_reserved_cores=1)
    assert set(profile.engine_env()) - {"VLLM_TARGET_DEVICE", *CPU_COMPILE_ENV} == set(MANAGED_ENV)
    assert set(MANAGED_ENV.values()) <= set(EngineProfile.model_fields)


# ---- refused -----------------------------------------------------------------------------------------------


def test_bind_naming_cores_the_host_lacks_is_refused(tmp_path: Path) -> None:
    assert (
        "cpu_threads_bind: '0-3' cannot be used on this host: this process may run only on cores 0-1, not on "
        "all of 0-3; bind only cores among 0-1, or use auto"
    ) in error_for(tmp_path, cpu_threads_bind="0-3")
    message = error_for(tmp_path, cpu_threads_bind="0,2-3|1,5", pipeline_parallel_size=2)
    assert "not on all of 2-3, 5; bind only cores among 0-1" in message


def test_host_cores_come_from_the_affinity_mask(fake_host: FakeHost, tmp_path: Path) -> None:
    assert REAL_HOST_CPU_IDS() == frozenset(os.sched_getaffinity(0))
    fake_host.use(cores={0, 2, 3, 7})  # e.g. `taskset -c 0,2,3,7`
    assert load(tmp_path, cpu_threads_bind="2-3").cpu_threads_bind == "2-3"
    assert "may run only on cores 0,2-3,7, not on all of 0-1" in error_for(tmp_path, cpu_threads_bind="0-1")


def test_reserved_cores_must_leave_one_to_compute(tmp_path: Path) -> None:
    assert load(tmp_path, cpu_reserved_cores=1).cpu_reserved_cores == 1
    assert (
        "cpu_reserved_cores: 2 reserved cores leave none of the 2 this process may run on (0-1) for vLLM's "
        "compute threads (vLLM would then warn and reserve none); reserve at most 1 (0 computes on every "
        "core)"
    ) in error_for(tmp_path, cpu_reserved_cores=2)
    assert "cpu_reserved_cores: -1 is not valid: Input should be greater than or equal to 0" in error_for(
        tmp_path, cpu_reserved_cores=-1
    )


@pytest.mark.parametrize("bind", ["0-1", "nobind"])
def test_reserved_cores_need_vllm_to_bind_itself(tmp_path: Path, bind: str) -> None:
    assert (
        "cpu_reserved_cores: vLLM keeps cores back only when it binds threads itself, and ignores it with "
        f"cpu_threads_bind {bind!r}; remove cpu_reserved_cores, or set cpu_threads_bind: auto"
    ) in error_for(tmp_path, cpu_threads_bind=bind, cpu_reserved_cores=0)


def test_both_are_refused_on_cuda(tmp_path: Path) -> None:
    message = error_for(tmp_path, device="cuda", cpu_threads_bind="auto", cpu_reserved_cores=0)
    assert (
        "cpu_threads_bind: only vLLM's CPU build reads it (as VLLM_CPU_OMP_THREADS_BIND), and this profile's "
        "device is cuda; remove cpu_threads_bind, or set device: cpu"
    ) in message
    assert (
        "cpu_reserved_cores: only vLLM's CPU build reads it (as VLLM_CPU_NUM_OF_RESERVED_CPU), and this "
        "profile's device is cuda; remove cpu_reserved_cores, or set device: cpu"
    ) in message


@pytest.mark.parametrize(
    ("bind", "why"),
    [
        ("3-1", "it is neither"),
        ("AUTO", "it is neither"),  # vLLM compares the mode words exactly
        ("", "it is neither"),
        ("0-", "it is neither"),
        ("-1", "it is neither"),
        (" 0", "it is neither"),
        ("0,,1", "'' is neither"),
        ("0,x", "'x' is neither"),
        ("0-1|", "'' in rank 1's list is neither"),
        ("0|1-0", "'1-0' in rank 1's list is neither"),
        ("0;1", "it is neither"),
    ],
)
def test_bad_core_list_syntax_is_refused(tmp_path: Path, bind: str, why: str) -> None:
    message = error_for(tmp_path, cpu_threads_bind=bind)
    assert (
        f"cpu_threads_bind: {bind!r} is not a thread binding vLLM reads: {why} a core id N nor a range N-M "
        "with M >= N; use auto, nobind, or core ids such as 0-1 or 0,2-3 (one list per rank, joined by '|')"
    ) in message


def test_huge_core_ranges_are_refused_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    assert "not on all of 0-999999999999" in error_for(tmp_path, cpu_threads_bind="0-999999999999")
    assert "is neither a core id" in error_for(tmp_path, cpu_threads_bind="9" * 5000)
    assert time.monotonic() - started < 2


@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("VLLM_CPU_OMP_THREADS_BIND", "cpu_threads_bind"),
        ("VLLM_CPU_NUM_OF_RESERVED_CPU", "cpu_reserved_cores"),
    ],
)
def test_setting_the_variables_directly_is_refused(tmp_path: Path, name: str, field: str) -> None:
    assert (
        f"env.{name}: repeats a variable the profile sets itself; remove it from env and set the profile "
        f"field {field!r} instead"
    ) in error_for(tmp_path, env={name: "0"})
    assert (
        f"secret_env[0]: repeats a variable the profile sets itself; remove it from secret_env and set the "
        f"profile field {field!r} instead"
    ) in error_for(tmp_path, secret_env=[name])


# ---- elsewhere ---------------------------------------------------------------------------------------------


def test_cpu_profile_still_validates_where_vllm_cpu_does_not_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rendering a CPU profile for another machine (a CI runner, a GPU box) checks no cores of this one."""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cuda")
    wide = load(tmp_path, cpu_threads_bind="0-63")
    assert wide.engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-63"
    assert load(tmp_path, cpu_reserved_cores=8).engine_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "8"
    # Syntax and the cuda refusal do not depend on the host.
    assert "is not a thread binding vLLM reads" in error_for(tmp_path, cpu_threads_bind="0-")
    assert "only vLLM's CPU build reads it" in error_for(tmp_path, device="cuda", cpu_reserved_cores=0)


def test_the_reserved_cores_are_a_sweep_knob_checked_against_the_host(
    tmp_path: Path, fake_host: FakeHost
) -> None:
    fake_host.use(cores={0, 1})
    spec = {
        "name": "threads",
        "base_profile": str(write_test_profile(tmp_path / "base.yaml")),
        "space": {"cpu_reserved_cores": [0, 1]},
        "slo": {"ttft_p99_s": 2.0},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    configs = [load_profile(tmp_path / "base.yaml").with_knobs(knobs) for knobs in load_spec(path).grid()]
    assert [c.engine_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] for c in configs] == ["0", "1"]
    path.write_text(yaml.safe_dump(spec | {"space": {"cpu_reserved_cores": [0, 2]}}))
    with pytest.raises(
        ConfigError, match=r"space.cpu_reserved_cores\[1\]: 2 is not usable: .*2 reserved cores"
    ):
        load_spec(path)


def test_an_engine_is_kept_on_every_core_its_bind_names_and_a_mode_keeps_it_nowhere() -> None:
    """Engine.start pins an engine's processes to these cores (its API server and engine core too)."""
    assert platform.bound_cores("1") == frozenset({1})
    assert platform.bound_cores("0|1") == frozenset({0, 1})  # one list per rank: every rank's cores
    assert platform.bound_cores(None) is None
    assert all(platform.bound_cores(mode) is None for mode in platform.CPU_BIND_MODES)
    # A range wider than the host is read against the host's cores, never expanded.
    assert platform.bound_cores("0-999999999") == HOST_CORES
