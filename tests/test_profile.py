"""Engine profiles: validation names the field and the fix; one model renders argv and serve YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.cli import main as cli_main
from kvtune.config_errors import ConfigError
from kvtune.profile import EngineProfile, load_profile
from tests.helpers import HOSTS, FakeHost

REPO = Path(__file__).resolve().parent.parent
PROFILES = sorted((REPO / "deploy" / "profiles").glob("*.yaml"))
BASE: dict[str, Any] = {
    "device": "cpu",
    "model": "smollm2-135m",
    "max_model_len": 8192,
    "kv_cache_memory_bytes": "1GiB",
}


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def error_for(tmp_path: Path, **changes: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load_profile(write(tmp_path, BASE | changes))
    return str(info.value)


# Unit tests see a host that can keep fp8 KV (AVX-512) unless a test says otherwise.
pytestmark = pytest.mark.usefixtures("fake_host")


def test_unknown_field_suggests_the_near_one(tmp_path: Path) -> None:
    message = error_for(tmp_path, max_num_seq=8)
    assert "max_num_seq: unknown field; did you mean 'max_num_seqs'?" in message
    assert str(tmp_path / "profile.yaml") in message


def test_wrong_type_names_field_and_value(tmp_path: Path) -> None:
    message = error_for(tmp_path, port="eighty")
    assert "port: 'eighty' is not valid: Input should be a valid integer" in message


def test_two_kv_budgets_are_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, gpu_memory_utilization=0.5)
    assert (
        "kv_cache_memory_bytes: set only one KV budget: remove either gpu_memory_utilization "
        "(a fraction of memory) or kv_cache_memory_bytes (an explicit size)"
    ) in message


def test_cpu_block_size_must_be_multiple_of_32(tmp_path: Path) -> None:
    message = error_for(tmp_path, block_size=16)
    assert (
        "block_size: 16 is not a multiple of 32, which vLLM's CPU attention needs; use 32, 64 or 128"
        in message
    )


def test_gpu_block_size_16_is_fine(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, BASE | {"device": "cuda", "block_size": 16}))
    args = profile.vllm_args()
    assert args.count("--block-size") == 1
    assert args[args.index("--block-size") + 1] == "16"


def test_budget_too_small_for_one_sequence_shows_the_arithmetic(tmp_path: Path) -> None:
    message = error_for(tmp_path, kv_cache_memory_bytes="64MiB", kv_cache_dtype="auto")
    assert (
        "kv_cache_memory_bytes: the KV budget leaves 2,688 usable tokens (one block is vLLM's), "
        "fewer than one max_model_len" in message
    )
    assert "sequence of 8,192" in message
    assert (
        "2 (K and V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes (auto) = 23,040 bytes/token" in message
    )
    assert "raise the budget to at least 180.00 MiB (188,743,680 bytes)" in message


def test_fp8_makes_the_same_budget_fit(tmp_path: Path) -> None:
    profile = load_profile(
        write(tmp_path, BASE | {"kv_cache_memory_bytes": "128MiB", "kv_cache_dtype": "fp8"})
    )
    assert profile.kv_capacity_tokens() == 11_648  # 128 MiB / 11,520 bytes, whole 128-token blocks


def test_block_cap_below_one_sequence_is_refused(tmp_path: Path) -> None:
    message = error_for(tmp_path, num_gpu_blocks_override=8, block_size=128)
    assert "capped at num_gpu_blocks_override 8 blocks" in message
    assert "leaves 896 usable tokens" in message


def test_kv_dtype_unknown_lists_choices(tmp_path: Path) -> None:
    message = error_for(tmp_path, kv_cache_dtype="fp9")
    assert "kv_cache_dtype: 'fp9' is not valid" in message
    assert "'auto', 'bfloat16', 'fp8', 'fp8_e4m3' or 'fp8_e5m2'" in message


def test_bfloat16_kv_is_refused_on_cpu(tmp_path: Path) -> None:
    message = error_for(tmp_path, kv_cache_dtype="bfloat16")
    assert (
        "kv_cache_dtype: 'bfloat16' is not a KV cache dtype vLLM supports on cpu; use one of auto, fp8"
        in message
    )


@pytest.mark.fake_host(cpu="avx2", device="cpu")
def test_fp8_refused_on_host_without_avx512(tmp_path: Path) -> None:
    message = error_for(tmp_path, kv_cache_dtype="fp8")
    assert (
        "kv_cache_dtype: 'fp8' cannot be used on this host: vLLM keeps an fp8 KV cache on CPU only with"
        in message
    )
    assert "set kv_cache_dtype_fallback: auto" in message


@pytest.mark.fake_host(device="cpu")
def test_fp8_fallback_adapts_to_host(tmp_path: Path, fake_host: FakeHost) -> None:
    data = BASE | {"kv_cache_dtype": "fp8", "kv_cache_dtype_fallback": "auto"}
    profile = load_profile(write(tmp_path, data))
    assert profile.adapted_to_host() == (profile, None)  # AVX-512 host: fp8 stays
    fake_host.use(cpu="avx2", device="cpu")
    adapted, note = profile.adapted_to_host()
    assert adapted.kv_cache_dtype == "auto"
    assert note is not None and note.startswith(
        "kv_cache_dtype fp8 -> auto: vLLM keeps an fp8 KV cache on CPU"
    )


def test_missing_model_is_named(tmp_path: Path) -> None:
    data = {k: v for k, v in BASE.items() if k != "model"}
    with pytest.raises(ConfigError, match="model: required field is missing; add it"):
        load_profile(write(tmp_path, data))


def test_warmup_file_must_exist_relative_to_profile(tmp_path: Path) -> None:
    message = error_for(tmp_path, warmup=[{"file": "missing.txt"}])
    assert "warmup[0].file: warm-up file" in message and "does not exist" in message
    (tmp_path / "prompt.txt").write_text("You are a helpful assistant.")
    profile = load_profile(write(tmp_path, BASE | {"warmup": [{"file": "prompt.txt"}]}))
    assert profile.warmup[0].content() == "You are a helpful assistant."


def test_argv_and_yaml_render_the_same_options(tmp_path: Path) -> None:
    data = BASE | {
        "kv_cache_dtype": "fp8",
        "enable_prefix_caching": False,
        "max_num_seqs": 4,
        "enforce_eager": True,
        "extra_args": ["--seed", "1"],
        "port": 8123,
    }
    profile = load_profile(write(tmp_path, data))
    argv = profile.argv("/models/smol")
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert argv[3:] == [
        "--model",
        "/models/smol",
        "--served-model-name",
        "smollm2-135m",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-model-len",
        "8192",
        "--kv-cache-memory-bytes",
        "1073741824",
        "--no-enable-prefix-caching",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--shutdown-timeout",
        "20",
        "--seed",
        "1",
    ]
    rendered = yaml.safe_load(profile.serve_yaml("/models/smol"))
    assert rendered == {
        "served-model-name": "smollm2-135m",
        "host": "127.0.0.1",
        "port": 8123,
        "max-model-len": 8192,
        "kv-cache-memory-bytes": 1073741824,
        "enable-prefix-caching": False,
        "kv-cache-dtype": "fp8",
        "max-num-seqs": 4,
        "enforce-eager": True,
        "shutdown-timeout": 20,
    }
    # The file holds settings; the model and extra_args stay on the command line its header gives.
    header = profile.serve_yaml("/models/smol").splitlines()[0]
    assert header == "# vllm serve /models/smol --config THIS_FILE --seed 1"


def test_an_extra_arg_on_two_lines_is_refused_before_vllm_judges_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"extra_args\[1\]: holds a control character"):
        load_profile(write(tmp_path, BASE | {"extra_args": ["--seed", "1\nport: 9"]}))


# What each shipped profile's KV pool holds by arithmetic as each host runs it: the CPU default keeps fp8
# KV (1 byte per element) with AVX-512 and falls back to the model's own 32-bit KV without it.
SHIPPED_KV = {
    "cpu-smollm2.yaml": {"avx512": ("fp8", 93_184), "avx2": ("auto", 23_296)},
    # Per GPU (tests/test_profile_parallel.py works both out by hand).
    "gpu-llama31-70b-a100-tp2pp2.yaml": {"avx512": ("auto", 534_064), "avx2": ("auto", 534_064)},
    "gpu-llama31-70b-h100-tp4.yaml": {"avx512": ("fp8", 1_026_176), "avx2": ("fp8", 1_026_176)},
    "gpu-llama31-8b-h100.yaml": {"avx512": ("fp8", 934_576), "avx2": ("fp8", 934_576)},
    "gpu-mistral-7b-h100-longctx.yaml": {"avx512": ("fp8_e4m3", 958_448), "avx2": ("fp8_e4m3", 958_448)},
    "gpu-qwen25-7b-a100.yaml": {"avx512": ("auto", 1_112_512), "avx2": ("auto", 1_112_512)},
}


def test_every_shipped_profile_has_expected_figures() -> None:
    assert sorted(SHIPPED_KV) == [p.name for p in PROFILES]


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_shipped_profiles_validate_on_both_cpu_hosts(path: Path, host: str, fake_host: FakeHost) -> None:
    fake_host.use(cpu=host, device="cpu")  # this host's vLLM build, whatever is installed
    profile = load_profile(path)
    assert profile.enable_prefix_caching
    adapted, note = profile.adapted_to_host()
    kv_dtype, tokens = SHIPPED_KV[path.name][host]
    assert (adapted.kv_cache_dtype, adapted.kv_capacity_tokens()) == (kv_dtype, tokens)
    assert tokens >= (profile.max_model_len or 0)
    if adapted.kv_cache_dtype != profile.kv_cache_dtype:
        # Only a CPU profile on a host without AVX-512 falls back, and it says why.
        assert (profile.device, host) == ("cpu", "avx2")
        assert note is not None and note.startswith(
            f"kv_cache_dtype {profile.kv_cache_dtype} -> {kv_dtype}: vLLM keeps an fp8 KV cache on CPU only "
            "with AVX-512 or AMX"
        )
        assert adapted.kv_cache_dtype_fallback is None
    else:
        assert note is None and adapted == profile


def test_gpu_profiles_cover_8b_class_models_on_80gb() -> None:
    gpu = [load_profile(p) for p in PROFILES if load_profile(p).device == "cuda"]
    assert len(gpu) >= 2
    assert all(p.accelerator_memory_gib == 80 and p.gpu_memory_utilization for p in gpu)


def test_render_cli_prints_argv_and_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["render", str(REPO / "deploy/profiles/gpu-llama31-8b-h100.yaml")]) == 0
    out = capsys.readouterr().out
    assert "--model meta-llama/Llama-3.1-8B-Instruct" in out
    assert "kv-cache-dtype: fp8" in out
    assert "KV capacity by arithmetic: 934,576 tokens" in out


def test_cli_reports_config_errors_with_exit_code_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, BASE | {"block_size": 16})
    assert cli_main(["render", str(path)]) == 2
    assert "block_size: 16 is not a multiple of 32" in capsys.readouterr().err


def test_profile_field_descriptions_exist() -> None:
    missing = [name for name, field in EngineProfile.model_fields.items() if not field.description]
    assert missing == []


def test_auto_kv_follows_model_dtype(tmp_path: Path) -> None:
    bf16 = load_profile(write(tmp_path, BASE | {"kv_cache_dtype": "auto"}))
    fp32 = load_profile(write(tmp_path, BASE | {"kv_cache_dtype": "auto", "dtype": "float32"}))
    fp8 = load_profile(write(tmp_path, BASE | {"kv_cache_dtype": "fp8", "dtype": "float32"}))
    assert (bf16.kv_capacity_tokens(), fp32.kv_capacity_tokens(), fp8.kv_capacity_tokens()) == (
        46_592,
        23_296,
        93_184,
    )
