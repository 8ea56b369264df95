"""Sweep specs: a bad knob, value, empty space or impossible SLO fails before any engine starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune import cli
from kvtune.config_errors import ConfigError
from kvtune.profile import load_profile
from kvtune.sweep.prune import candidates
from kvtune.sweep.spec import load_spec
from tests.helpers import HOSTS, FakeHost

REPO = Path(__file__).resolve().parent.parent
BASE_PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
SPEC: dict[str, Any] = {
    "name": "t",
    "base_profile": str(BASE_PROFILE),
    "space": {"kv_cache_dtype": ["auto", "fp8"], "max_num_seqs": [4, 8]},
    "slo": {"ttft_p99_s": 1.5},
}


pytestmark = pytest.mark.usefixtures("fake_host")  # an AVX-512 host: fp8 KV is kept


def write(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SPEC | changes))
    return path


def error_for(tmp_path: Path, **changes: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_spec(write(tmp_path, **changes))
    return str(info.value)


def test_grid_is_every_combination(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path))
    assert spec.grid() == [
        {"kv_cache_dtype": "auto", "max_num_seqs": 4},
        {"kv_cache_dtype": "auto", "max_num_seqs": 8},
        {"kv_cache_dtype": "fp8", "max_num_seqs": 4},
        {"kv_cache_dtype": "fp8", "max_num_seqs": 8},
    ]


def test_ranges_expand_on_their_step(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, space={"gpu_memory_utilization": {"min": 0.5, "max": 0.8, "step": 0.1}}))
    assert spec.candidates() == {"gpu_memory_utilization": [0.5, 0.6, 0.7, 0.8]}


def test_unknown_knob_suggests_the_near_one(tmp_path: Path) -> None:
    message = error_for(tmp_path, space={"kv_cache_dtypo": ["fp8"]})
    assert "space: 'kv_cache_dtypo' is not a knob a sweep can vary; did you mean 'kv_cache_dtype'?" in message


def test_bad_value_names_its_index_and_the_choices(tmp_path: Path) -> None:
    message = error_for(tmp_path, space={"kv_cache_dtype": ["auto", "fp8", "fp9"]})
    assert (
        "space.kv_cache_dtype[2]: 'fp9' is not usable: Input should be 'auto', 'bfloat16', 'fp8'" in message
    )


def test_value_that_breaks_the_platform_is_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, space={"block_size": [128, 16]})
    assert "space.block_size[1]: 16 is not usable: 16 is not a multiple of 32" in message


def test_budget_too_small_for_one_sequence_is_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, space={"kv_cache_memory_bytes": ["1GiB", "16MiB"]})
    assert (
        "space.kv_cache_memory_bytes[1]: '16MiB' is not usable: kv_cache_memory_bytes: the KV budget leaves"
        in message
    )


def test_empty_space_and_empty_knob(tmp_path: Path) -> None:
    assert "the search space is empty; give at least one knob" in error_for(tmp_path, space={})
    assert "max_num_seqs has no candidate values; list at least one" in error_for(
        tmp_path, space={"max_num_seqs": []}
    )


@pytest.mark.parametrize(
    ("slo", "expected"),
    [
        ({}, "set at least one latency target, e.g. ttft_p90_s or itl_p99_s"),
        ({"ttft_p99_s": -1}, "slo.ttft_p99_s: -1 is not valid: Input should be greater than 0"),
        (
            {"ttft_p99_s": 2.0, "e2e_p99_s": 1.0},
            "e2e_p99_s 1.0 is below the TTFT target 2.0: no request can meet both",
        ),
        (
            {"ttft_p99_s": 1.0, "max_error_rate": 1.0},
            "slo.max_error_rate: 1.0 is not valid: Input should be less than 1",
        ),
    ],
)
def test_impossible_slo(tmp_path: Path, slo: dict[str, Any], expected: str) -> None:
    assert expected in error_for(tmp_path, slo=slo)


def test_a_spec_whose_steps_can_never_pass_is_refused_with_the_arithmetic(tmp_path: Path) -> None:
    """The default 1% error share at 95% needs 299 requests without an error (0.99^299 < 0.05): at most
    0.5 req/s for 4 x 30 s = 120 s sends ~60, so every step would end undecided and the goodput be 0."""
    message = error_for(tmp_path, load={"start_rate": 0.25, "max_rate": 0.5})
    assert (
        "slo.max_error_rate: at confidence 0.95 a step needs 299 requests to pass, but a step at "
        "load.max_rate 0.5 req/s measured for at most 120 s (load.max_step_seconds) sends ~60: no step could "
        "pass. Raise load.max_step_seconds to 598 or more, raise slo.max_error_rate, or lower slo.confidence"
    ) in message
    # A p99 needs as many samples; ITL counts each request's gaps (31 for 32-token answers): 10 requests.
    lax = {"max_error_rate": 0.5}
    message = error_for(tmp_path, slo=lax | {"ttft_p99_s": 2.0}, load={"start_rate": 0.25, "max_rate": 0.5})
    assert "slo.ttft_p99_s: at confidence 0.95 a step needs 299 requests" in message
    assert "target a lower quantile than slo.ttft_p99_s" in message
    spec = load_spec(
        write(tmp_path, slo=lax | {"ttft_p99_s": None, "itl_p99_s": 0.5}, workload={"max_tokens": 32},
              load={"start_rate": 0.05, "max_rate": 0.5})
    )  # fmt: skip
    assert spec.requests_to_pass() == (10, "slo.itl_p99_s")


def test_rates_too_low_to_pass_are_named_before_the_sweep(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, load={"start_rate": 0.5, "max_rate": 8.0}))
    assert spec.slowest_passable_rate() == pytest.approx(299 / 120)
    note = spec.passable_rate_note()
    assert note is not None and note.startswith("rates below 2.49 req/s cannot pass: slo.max_error_rate")
    assert "raise load.max_step_seconds to 598 or more" in note
    assert load_spec(write(tmp_path, load={"start_rate": 2.5, "max_rate": 8.0})).passable_rate_note() is None


def test_missing_base_profile(tmp_path: Path) -> None:
    message = error_for(tmp_path, base_profile="nope.yaml")
    assert (
        "base_profile: profile" in message
        and "does not exist; fix the path (relative to this file's folder)" in message
    )


def test_apply_knobs_switches_the_budget_kind() -> None:
    base = load_profile(BASE_PROFILE)
    profile = base.with_knobs({"gpu_memory_utilization": 0.3, "max_num_seqs": 4})
    assert profile.kv_cache_memory_bytes is None and profile.gpu_memory_utilization == 0.3
    assert profile.max_num_seqs == 4 and profile.model == base.model


SPECS = sorted((REPO / "deploy" / "sweeps").glob("*.yaml"))
# Per shipped spec: configs in its grid, then per host the KV dtypes its trials run and how many configs the
# KV arithmetic prunes. The CPU specs' base profile keeps fp8 KV with AVX-512; without it every trial falls
# back to 32-bit KV, whose pool holds a quarter of the tokens, so the smallest budgets are pruned.
SHIPPED_SPECS = {
    "cpu-full.yaml": (12, {"avx512": ({"fp8"}, 0), "avx2": ({"auto"}, 2)}),
    "cpu-tradeoff.yaml": (12, {"avx512": ({"auto"}, 0), "avx2": ({"auto"}, 0)}),
    "cpu-quick.yaml": (2, {"avx512": ({"auto"}, 0), "avx2": ({"auto"}, 0)}),
    "gpu-llama31-8b-h100.yaml": (36, {"avx512": ({"auto", "fp8"}, 0), "avx2": ({"auto", "fp8"}, 0)}),
    "gpu-llama31-8b-h100-tradeoff.yaml": (18, {"avx512": ({"fp8"}, 0), "avx2": ({"fp8"}, 0)}),
    "gpu-mistral-7b-h100-longctx.yaml": (12, {"avx512": ({"fp8_e4m3"}, 6), "avx2": ({"fp8_e4m3"}, 6)}),
}


def test_every_shipped_spec_has_expected_figures() -> None:
    assert sorted(SHIPPED_SPECS) == [p.name for p in SPECS]


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_validate_and_keep_something_to_measure(
    path: Path, host: str, fake_host: FakeHost
) -> None:
    fake_host.use(host, device="cpu")  # this host's vLLM build, whatever is installed
    spec = load_spec(path)
    base = load_profile(spec.base_profile)
    configs = candidates(spec, base, spec.grid())
    size, per_host = SHIPPED_SPECS[path.name]
    kv_dtypes, pruned = per_host[host]
    assert len(configs) == size
    assert {c.profile.kv_cache_dtype for c in configs if c.profile} == kv_dtypes
    assert sum(c.skipped(spec.prune_by_kv) for c in configs) == pruned
    assert any(not c.skipped(spec.prune_by_kv) for c in configs), f"{path.name}: every config is pruned"
    _adapted, note = base.adapted_to_host()
    # The sweep's host note (summary.json, the report) says when this host changed the base profile.
    fell_back = base.device == "cpu" and host == "avx2"
    assert (note is not None) == fell_back, note
    if note:
        assert note.startswith(
            "kv_cache_dtype fp8 -> auto: vLLM keeps an fp8 KV cache on CPU only with AVX-512"
        )


def test_the_dry_run_names_the_rates_that_cannot_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["sweep", "--dry-run", str(write(tmp_path, load={"start_rate": 0.5, "max_rate": 8.0}))])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 0
    assert "note: rates below 2.49 req/s cannot pass: slo.max_error_rate at confidence 0.95 needs 299" in err
