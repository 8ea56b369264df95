"""Tensor, pipeline and data parallelism in a profile: the flags, what vLLM refuses before it starts, and the
KV pool of one GPU (rank), checked against figures worked out by hand below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvtune import kv_math, platform
from kvtune.config_errors import ConfigError
from kvtune.profile import EngineProfile, knobs, load_profile
from kvtune.sweep.prune import candidates
from kvtune.sweep.spec import SweepSpec
from tests.helpers import FakeHost

REPO = Path(__file__).resolve().parent.parent
TP4 = REPO / "deploy" / "profiles" / "gpu-llama31-70b-h100-tp4.yaml"
TP2PP2 = REPO / "deploy" / "profiles" / "gpu-llama31-70b-a100-tp2pp2.yaml"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"

# ---- the figures, by hand ----------------------------------------------------------------------------------
# Llama 3.1 70B: 70,553,706,496 parameters x 2 bytes (bf16) = 141,107,412,992 bytes of weights.
# One 80 GiB GPU: 80 x 1,073,741,824 = 85,899,345,920 bytes.
#
# TP 4 (H100, gpu_memory_utilization 0.90, fp8 KV, blocks of 16):
#   KV bytes/token per GPU = 2 x 80 layers x (8 KV heads / 4 = 2) x 128 head dim x 1 byte = 40,960
#   weights per GPU        = 141,107,412,992 / (4 x 1) = 35,276,853,248
#   pool per GPU           = 0.90 x 85,899,345,920 - 35,276,853,248 = 77,309,411,328 - 35,276,853,248
#                          = 42,032,558,080
#   blocks                 = 42,032,558,080 // (40,960 x 16 = 655,360) = 64,136 (64,136 x 655,360 =
#                            42,032,168,960; 389,120 left over) -> 64,136 x 16 = 1,026,176 tokens
TP4_BYTES_PER_TOKEN = 40_960
TP4_WEIGHTS = 35_276_853_248
TP4_POOL = 42_032_558_080
TP4_TOKENS = 1_026_176
# TP 2 x PP 2 (A100, gpu_memory_utilization 0.92, 16-bit KV, blocks of 16):
#   KV bytes/token per GPU = 2 x (80 layers / 2 = 40) x (8 KV heads / 2 = 4) x 128 x 2 bytes = 81,920
#   weights per GPU        = 141,107,412,992 / (2 x 2) = 35,276,853,248
#   pool per GPU           = 0.92 x 85,899,345,920 - 35,276,853,248 = 79,027,398,246.4 - 35,276,853,248
#                          = 43,750,544,998 (whole bytes)
#   blocks                 = 43,750,544,998 // (81,920 x 16 = 1,310,720) = 33,379 (33,379 x 1,310,720 =
#                            43,750,522,880; 22,118 left over) -> 33,379 x 16 = 534,064 tokens
TP2PP2_BYTES_PER_TOKEN = 81_920
TP2PP2_POOL = 43_750_544_998
TP2PP2_TOKENS = 534_064


def profile(**fields: Any) -> EngineProfile:
    data = {
        "device": "cuda",
        "model": LLAMA_70B,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.9,
        "accelerator_memory_gib": 80,
        "block_size": 16,
    }
    return EngineProfile.model_validate(data | fields)


def refusal(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        profile(**fields)
    return "; ".join(str(e["msg"]) for e in info.value.errors())


# ---- per-GPU arithmetic ------------------------------------------------------------------------------------


def test_tp4_profile_holds_the_hand_worked_pool_per_gpu() -> None:
    tp4 = load_profile(TP4)
    geometry = kv_math.KNOWN_MODELS[LLAMA_70B]
    assert (tp4.tensor_parallel_size, tp4.pipeline_parallel_size, tp4.kv_cache_dtype) == (4, 1, "fp8")
    assert geometry.kv_bytes_per_token("fp8", "auto", tp=4, pp=1) == TP4_BYTES_PER_TOKEN
    assert geometry.weight_bytes_per_rank("auto", tp=4, pp=1) == TP4_WEIGHTS
    budget = tp4.kv_budget_bytes(geometry)
    assert budget is not None and budget[0] == TP4_POOL
    assert "32.85 GiB weights (131.42 GiB / TP 4 x PP 1)" in budget[1] and budget[1].endswith("per GPU")
    assert tp4.kv_capacity_tokens() == TP4_TOKENS
    assert tp4.usable_kv_tokens() == TP4_TOKENS - 16  # the null block
    assert tp4.capacity_problem() is None


def test_tp2pp2_profile_holds_the_hand_worked_pool_per_gpu() -> None:
    split = load_profile(TP2PP2)
    geometry = kv_math.KNOWN_MODELS[LLAMA_70B]
    assert geometry.kv_bytes_per_token("auto", "auto", tp=2, pp=2) == TP2PP2_BYTES_PER_TOKEN
    assert geometry.weight_bytes_per_rank("auto", tp=2, pp=2) == TP4_WEIGHTS  # a quarter either way
    budget = split.kv_budget_bytes(geometry)
    assert budget is not None and budget[0] == TP2PP2_POOL
    assert split.kv_capacity_tokens() == TP2PP2_TOKENS
    assert geometry.explain_bytes_per_token("auto", "auto", tp=2, pp=2) == (
        "2 (K and V) x 40 layers (80 / PP 2) x 4 KV heads (8 / TP 2) x 128 head dim x 2 bytes (auto)"
        " = 81,920 bytes/token per GPU"
    )


def test_the_largest_pipeline_stage_sizes_the_pool() -> None:
    # vLLM's get_pp_indices: 80 layers over 3 stages are 26, 27, 27; the pool is the 27-layer stage's.
    geometry = kv_math.KNOWN_MODELS[LLAMA_70B]
    assert geometry.layers_per_rank(3) == 27
    # 2 x 27 x 8 x 128 x 2 = 110,592
    assert geometry.kv_bytes_per_token("auto", tp=1, pp=3) == 110_592


def test_tp_beyond_the_kv_heads_keeps_one_replicated_head_per_gpu() -> None:
    geometry = kv_math.KNOWN_MODELS[LLAMA_70B]
    # TP 16 > 8 KV heads: each GPU keeps one (2 x 80 x 1 x 128 x 2 = 40,960), not half of one.
    assert geometry.kv_bytes_per_token("auto", tp=16) == 40_960
    assert "1 KV heads (8 / TP 16: one replicated per GPU)" in geometry.explain_bytes_per_token("auto", tp=16)


def test_an_explicit_kv_budget_is_per_gpu() -> None:
    # vLLM's workers each reserve kv_cache_memory_bytes: 8 GiB = 8,589,934,592 bytes on every GPU.
    # TP 4, 16-bit KV: 2 x 80 x 2 x 128 x 2 = 81,920 bytes/token; 8,589,934,592 // 1,310,720 = 6,553 blocks
    # -> 104,848 tokens per GPU (each GPU holds the same tokens, a quarter of their heads).
    tp4 = profile(tensor_parallel_size=4, gpu_memory_utilization=None, kv_cache_memory_bytes="8GiB")
    assert tp4.kv_capacity_tokens() == 104_848


def test_data_parallel_copies_are_counted_per_copy() -> None:
    # DP 2 x TP 4: each copy has the TP 4 pool of its own, the figures are one copy's.
    copies = profile(tensor_parallel_size=4, data_parallel_size=2, kv_cache_dtype="fp8")
    assert copies.kv_capacity_tokens() == TP4_TOKENS
    message = refusal(
        tensor_parallel_size=4,
        data_parallel_size=2,
        gpu_memory_utilization=None,
        kv_cache_memory_bytes="1GiB",
    )
    assert "per GPU of each of the 2 data-parallel engines (each has its own pool)" in message


# ---- refused before any engine starts ----------------------------------------------------------------------


def test_70b_on_one_80gb_gpu_is_refused_with_the_least_tp_that_fits() -> None:
    # 141,107,412,992 bytes of weights / 77,309,411,328 usable (0.9 x 80 GiB) = 1.83 -> TP 2.
    message = refusal()
    assert message.startswith("Value error, tensor_parallel_size: the weights do not fit one GPU")
    assert "131.42 GiB per GPU, not below the 72.00 GiB vLLM may use there" in message
    assert "raise tensor_parallel_size to at least 2" in message
    # 0.3 x 80 GiB = 25,769,803,776 usable: 141,107,412,992 / 25,769,803,776 = 5.48 -> 6, which does not
    # divide the 64 attention heads: 8.
    assert "raise tensor_parallel_size to at least 8" in refusal(gpu_memory_utilization=0.3)
    # With PP 2 each TP rank holds half the layers: 5.48 / 2 = 2.74 -> 3 -> 4.
    assert "at least 4" in refusal(gpu_memory_utilization=0.3, pipeline_parallel_size=2)


def test_tp_the_heads_cannot_take_is_refused() -> None:
    qwen = {"model": "Qwen/Qwen2.5-7B-Instruct", "gpu_memory_utilization": 0.9}
    # 28 attention heads, 4 KV heads: 7 divides the heads but neither divides nor is divided by 4 KV heads.
    assert (
        "tensor_parallel_size 7 and the model's 4 KV heads: vLLM needs the KV heads to divide by TP, or TP "
        "by the KV heads; use one of 1, 2, 4, 28"
    ) in refusal(**qwen, tensor_parallel_size=7)
    assert (
        "tensor_parallel_size 8 does not divide the model's 28 attention heads, as vLLM requires; use one of "
        "1, 2, 4, 28"
    ) in refusal(**qwen, tensor_parallel_size=8)
    assert profile(**qwen, tensor_parallel_size=4).kv_capacity_tokens()


def test_pipeline_stages_beyond_the_layers_are_refused() -> None:
    small = {"model": "meta-llama/Llama-3.1-8B-Instruct", "max_model_len": 8192}
    assert "pipeline_parallel_size 33 exceeds the model's 32 layers" in refusal(
        **small, pipeline_parallel_size=33
    )
    assert profile(**small, pipeline_parallel_size=32).pipeline_parallel_size == 32


def test_parallel_engines_are_not_replicated_by_kvtune_up() -> None:
    assert "replicas 2 with tensor_parallel_size 4" in refusal(tensor_parallel_size=4, replicas=2)


def test_sizes_are_bounded() -> None:
    assert "greater than or equal to 1" in refusal(tensor_parallel_size=0)
    assert "less than or equal to 64" in refusal(data_parallel_size=65)


# ---- rendering ---------------------------------------------------------------------------------------------


def test_parallel_sizes_revision_and_load_format_render_as_flags() -> None:
    args = load_profile(TP4).vllm_args()
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--revision") + 1] == "main"
    assert args[args.index("--load-format") + 1] == "safetensors"
    assert "--pipeline-parallel-size" not in args and "--data-parallel-size" not in args
    split = load_profile(TP2PP2).vllm_args()
    assert split[split.index("--tensor-parallel-size") + 1] == "2"
    assert split[split.index("--pipeline-parallel-size") + 1] == "2"
    serve = load_profile(TP2PP2).serve_yaml()
    assert "tensor-parallel-size: 2\n" in serve and "revision: main\n" in serve
    copies = profile(tensor_parallel_size=4, data_parallel_size=2, kv_cache_dtype="fp8").vllm_args()
    assert copies[copies.index("--data-parallel-size") + 1] == "2"


def test_the_defaults_render_no_flag() -> None:
    plain = EngineProfile.model_validate({"device": "cuda", "model": "meta-llama/Llama-3.1-8B-Instruct"})
    assert (plain.tensor_parallel_size, plain.pipeline_parallel_size, plain.data_parallel_size) == (1, 1, 1)
    rendered = " ".join(plain.vllm_args())
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"):
        assert flag not in rendered
    assert "--revision" not in rendered and "--load-format" not in rendered


def test_revision_is_one_word_and_load_format_one_vllm_knows() -> None:
    assert "one word without spaces" in refusal(tensor_parallel_size=2, revision="main\nrm -rf")
    assert "one word without spaces" in refusal(tensor_parallel_size=2, revision="")
    assert "'runai_streamer'" in refusal(tensor_parallel_size=2, load_format="dummy")
    assert profile(tensor_parallel_size=2, load_format="runai_streamer").load_format == "runai_streamer"


# ---- vLLM's CPU build -------------------------------------------------------------------------------------

CPU_BASE: dict[str, Any] = {"device": "cpu", "model": "smollm2-135m", "kv_cache_memory_bytes": "1GiB"}


def cpu_profile(**fields: Any) -> EngineProfile:
    return EngineProfile.model_validate(CPU_BASE | fields)


def cpu_refusal(**fields: Any) -> str:
    with pytest.raises(ValidationError) as info:
        cpu_profile(**fields)
    return "; ".join(str(e["msg"]) for e in info.value.errors())


@pytest.fixture
def numa_nodes(monkeypatch: pytest.MonkeyPatch) -> Any:
    def use(nodes: set[int]) -> None:
        monkeypatch.setattr(platform, "host_memory_nodes", lambda: frozenset(nodes))

    use({0})
    return use


@pytest.mark.fake_host(cores={0, 1, 2, 3}, device="cpu")
def test_cpu_ranks_take_one_core_list_each(fake_host: FakeHost, numa_nodes: Any) -> None:
    staged = cpu_profile(pipeline_parallel_size=2, cpu_threads_bind="0-1|2-3")
    assert staged.engine_env()["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    args = staged.vllm_args()
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert (
        "cpu_threads_bind '0-3' gives 1 core list and pipeline_parallel_size 2 makes 2 ranks: vLLM needs one "
        "core list per rank, joined by '|'"
    ) in cpu_refusal(pipeline_parallel_size=2, cpu_threads_bind="0-3")
    # Data parallel copies on one host each take TP x PP lists: 2 x 2 = 4.
    assert cpu_profile(pipeline_parallel_size=2, data_parallel_size=2, cpu_threads_bind="0|1|2|3")
    assert "gives 2 core lists" in cpu_refusal(
        pipeline_parallel_size=2, data_parallel_size=2, cpu_threads_bind="0-1|2-3"
    )
    # nobind leaves placement to the OS, one list or none.
    assert cpu_profile(pipeline_parallel_size=2, cpu_threads_bind="nobind").pipeline_parallel_size == 2


@pytest.mark.fake_host(cores={0, 1}, device="cpu")
def test_cpu_ranks_must_fit_the_hosts_cores(fake_host: FakeHost, numa_nodes: Any) -> None:
    message = cpu_refusal(pipeline_parallel_size=3, cpu_threads_bind="0|1|1")
    assert (
        "pipeline_parallel_size 3 makes 3 ranks, each computing on cores of its own, and this process may "
        "run on 2 (0-1); lower tensor_parallel_size, pipeline_parallel_size or data_parallel_size"
    ) in message
    fake_host.use(cores={0, 1, 2}, device="cpu")
    assert cpu_profile(pipeline_parallel_size=3, cpu_threads_bind="0|1|2").pipeline_parallel_size == 3


@pytest.mark.fake_host(cores={0, 1, 2, 3}, device="cpu")
def test_cpu_auto_binding_needs_a_numa_node_per_rank(fake_host: FakeHost, numa_nodes: Any) -> None:
    assert (
        "cpu_threads_bind auto: vLLM's auto binding gives each of the 2 ranks of pipeline_parallel_size 2 a "
        "NUMA node of its own, and this host has 1; set cpu_threads_bind to one core list per rank, e.g. "
        "0-1|2-3"
    ) in cpu_refusal(pipeline_parallel_size=2)
    numa_nodes({0, 1})
    assert cpu_profile(pipeline_parallel_size=2).cpu_threads_bind is None


@pytest.mark.fake_host(cores={0, 1, 2, 3}, device="cpu")
def test_cpu_heads_rule_holds_too(fake_host: FakeHost, numa_nodes: Any) -> None:
    # SmolLM2: 9 attention heads, 3 KV heads: TP 3 splits both, TP 2 neither.
    assert cpu_profile(tensor_parallel_size=3, cpu_threads_bind="0|1|2").tensor_parallel_size == 3
    assert "tensor_parallel_size 2 does not divide the model's 9 attention heads" in cpu_refusal(
        tensor_parallel_size=2, cpu_threads_bind="0-1|2-3"
    )


@pytest.mark.fake_host(cores={0, 1, 2, 3}, device="cpu")
def test_cpu_step_budget_default_scales_with_ranks(fake_host: FakeHost, numa_nodes: Any) -> None:
    # vLLM's CPU default is 2,048 tokens per rank of an engine (get_batch_defaults x TP x PP).
    staged = cpu_profile(pipeline_parallel_size=2, cpu_threads_bind="0-1|2-3")
    assert staged.effective_max_num_batched_tokens() == 4096


# ---- the sweep ---------------------------------------------------------------------------------------------


def sweep(space: dict[str, list[Any]], **workload: Any) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "tp",
            "base_profile": str(TP4),
            "space": space,
            "workload": {"name": "multi_turn", "users": 64} | workload,
            "slo": {"ttft_p99_s": 2.0},
        }
    )


def test_tensor_parallel_size_is_a_sweep_knob() -> None:
    assert "tensor_parallel_size" in knobs(EngineProfile)
    assert "pipeline_parallel_size" not in knobs(EngineProfile)
    assert sweep({"tensor_parallel_size": [4, 8]}).space["tensor_parallel_size"] == [4, 8]
    with pytest.raises((ValidationError, ConfigError)) as info:
        sweep({"tensor_parallel_size": [4, 3]})
    assert "space.tensor_parallel_size[1]: 3 is not usable" in str(info.value)
    assert "does not divide the model's 64 attention heads" in str(info.value)


def test_pruning_sees_the_per_gpu_pool() -> None:
    # 64 users x 10 turns x (2,000 + 100) tokens = 21,000 tokens -> 21,008 in blocks of 16; 64 x 21,008 =
    # 1,344,512 tokens.
    # TP 4 holds 1,026,176 - 16 = 1,026,160 usable tokens: pruned.
    # TP 8: 2 x 80 x 1 x 128 x 1 = 20,480 bytes/token; 77,309,411,328 - 141,107,412,992 / 8 (17,638,426,624)
    # = 59,670,984,704 bytes // 327,680 = 182,101 blocks = 2,913,616 tokens: kept.
    spec = sweep({"tensor_parallel_size": [4, 8]}, args={"turns": 10, "turn-tokens": 2000}, max_tokens=100)
    base = load_profile(TP4)
    by_tp = {c.knobs["tensor_parallel_size"]: c for c in candidates(spec, base, spec.grid())}
    assert by_tp[4].pruned is not None
    assert by_tp[4].pruned.startswith(
        "KV pool has 1,026,160 usable tokens; 64 requests running need 1,344,512 (shared prefix once + 64 x "
        "21,008 per request"
    )
    assert by_tp[8].pruned is None
    assert by_tp[8].profile is not None and by_tp[8].profile.kv_capacity_tokens() == 2_913_616
