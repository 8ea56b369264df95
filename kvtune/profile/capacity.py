"""A profile's KV pool by arithmetic: its budget in bytes, the tokens it holds, and why it cannot hold one
max_model_len sequence (before any engine starts)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtune import kv_math
from kvtune.platform import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS, tokens_after_null_block

if TYPE_CHECKING:
    from kvtune.profile.model import EngineProfile


def block_size(profile: EngineProfile) -> int:
    return profile.block_size or DEFAULT_BLOCK_SIZE[profile.device]


def per_gpu(profile: EngineProfile) -> str:
    """How the figures are counted: per GPU (rank) under TP/PP, per engine under DP, or "" for one GPU."""
    ranks = profile.tensor_parallel_size * profile.pipeline_parallel_size
    where = " per GPU" if ranks > 1 else ""
    if profile.data_parallel_size > 1:
        where += f" of each of the {profile.data_parallel_size} data-parallel engines (each has its own pool)"
    return where


def kv_budget_bytes(profile: EngineProfile, geometry: kv_math.ModelGeometry) -> tuple[int, str] | None:
    """One GPU's KV pool in bytes and how it was derived, when the profile fixes it; None for vLLM's default.

    Both budgets are per worker in vLLM 0.32.0: each GPU worker reserves kv_cache_memory_bytes for itself
    (`Worker.determine_available_memory`, vllm/v1/worker/gpu_worker.py) and takes gpu_memory_utilization of
    its own GPU."""
    tp, pp = profile.tensor_parallel_size, profile.pipeline_parallel_size
    if profile.kv_cache_memory_bytes is not None:
        return int(profile.kv_cache_memory_bytes), (
            f"kv_cache_memory_bytes {profile.kv_cache_memory_bytes:,}{per_gpu(profile)}"
        )
    if profile.gpu_memory_utilization is not None and profile.accelerator_memory_gib is not None:
        weights = geometry.weight_bytes_per_rank(profile.dtype, tp, pp)
        kv = int(_usable_memory(profile) - weights)
        split = (
            f" ({kv_math.format_bytes(geometry.weight_bytes_per_rank(profile.dtype))} / TP {tp} x PP {pp})"
        )
        return kv, (
            f"gpu_memory_utilization {profile.gpu_memory_utilization} x {profile.accelerator_memory_gib} GiB"
            f" - {kv_math.format_bytes(weights)} weights{split if tp * pp > 1 else ''}"
            f" = at most {kv_math.format_bytes(kv)}{per_gpu(profile)}"
        )
    return None


def _usable_memory(profile: EngineProfile) -> float:
    """The memory vLLM may use on one GPU (0 when the profile does not say)."""
    return (profile.accelerator_memory_gib or 0) * kv_math.GIB * (profile.gpu_memory_utilization or 0)


def kv_bytes_per_token(profile: EngineProfile, geometry: kv_math.ModelGeometry) -> int:
    """One GPU's KV bytes per token at the profile's KV dtype, model dtype and parallel sizes."""
    return geometry.kv_bytes_per_token(
        profile.kv_cache_dtype, profile.dtype, profile.tensor_parallel_size, profile.pipeline_parallel_size
    )


def kv_capacity_tokens(profile: EngineProfile) -> int | None:
    """Tokens the KV pool holds by arithmetic, when model geometry and budget are both known: one GPU's
    pool over one GPU's bytes per token (every rank holds the same tokens, each its share of the layers and
    heads); with data parallelism, one engine's."""
    geometry = kv_math.lookup_geometry(profile.model)
    budget = geometry and kv_budget_bytes(profile, geometry)
    if not geometry or not budget:
        return None
    return kv_math.kv_tokens(
        max(budget[0], 0),
        kv_bytes_per_token(profile, geometry),
        block_size(profile),
        profile.num_gpu_blocks_override,
    )


def usable_kv_tokens(profile: EngineProfile) -> int | None:
    """Tokens requests can use: vLLM keeps one block of the pool back (its null block)."""
    capacity = kv_capacity_tokens(profile)
    return None if capacity is None else tokens_after_null_block(capacity, block_size(profile))


def weights_problem(profile: EngineProfile) -> str | None:
    """Why one GPU cannot hold its share of the weights within gpu_memory_utilization, with the figures and
    the smallest tensor_parallel_size that fits; None when it can (or the figures are unknown)."""
    geometry = kv_math.lookup_geometry(profile.model)
    if geometry is None or profile.gpu_memory_utilization is None or profile.accelerator_memory_gib is None:
        return None
    tp, pp = profile.tensor_parallel_size, profile.pipeline_parallel_size
    usable = _usable_memory(profile)
    weights = geometry.weight_bytes_per_rank(profile.dtype, tp, pp)
    if weights < usable:
        return None
    total = geometry.weight_bytes_per_rank(profile.dtype)
    # The least TP whose share is below the usable memory, raised to one vLLM can split the model into.
    ratio = total / (pp * usable)  # a tiny accelerator_memory_gib makes it huge, or infinite
    least = int(ratio) + 1 if ratio < _MAX_RANKS else _MAX_RANKS + 1
    fits = next(
        (n for n in range(max(least, tp + 1), _MAX_RANKS + 1) if geometry.parallel_problem(n, pp) is None),
        None,
    )
    fix = (
        f"raise tensor_parallel_size to at least {fits}"
        if fits is not None
        else "use GPUs with more memory, or a smaller model"
    )
    return (
        f"the weights do not fit one GPU: {kv_math.format_bytes(total)} of weights / (TP {tp} x PP {pp}) = "
        f"{kv_math.format_bytes(weights)} per GPU, not below the {kv_math.format_bytes(usable)} vLLM may "
        f"use there (gpu_memory_utilization {profile.gpu_memory_utilization} x "
        f"{profile.accelerator_memory_gib} GiB), which leaves nothing for the KV cache; {fix}"
        + (" (or raise pipeline_parallel_size)" if fits is not None else "")
    )


# The most ranks a profile's parallel sizes allow (their `le` bound in the profile).
_MAX_RANKS = 64


def capacity_problem(profile: EngineProfile) -> str | None:
    """Why this KV budget cannot hold one `max_model_len` sequence, with the arithmetic; else None."""
    geometry = kv_math.lookup_geometry(profile.model)
    if geometry is None:
        return None
    budget = kv_budget_bytes(profile, geometry)
    seq_len = profile.max_model_len or geometry.max_position_embeddings
    capacity = usable_kv_tokens(profile)
    if budget is None or capacity is None or capacity >= seq_len:
        return None
    tp, pp = profile.tensor_parallel_size, profile.pipeline_parallel_size
    per_token = kv_bytes_per_token(profile, geometry)
    cap = ""
    if profile.num_gpu_blocks_override is not None:
        cap = f", capped at num_gpu_blocks_override {profile.num_gpu_blocks_override} blocks"
    needed = seq_len * per_token
    return (
        f"the KV budget leaves {capacity:,} usable tokens (one block is vLLM's), fewer than one "
        f"max_model_len sequence of {seq_len:,}: "
        f"{budget[1]} / ({geometry.explain_bytes_per_token(profile.kv_cache_dtype, profile.dtype, tp, pp)})"
        f" in blocks of {block_size(profile)}{cap}; "
        f"raise the budget to at least {kv_math.format_bytes(needed)} ({needed:,} bytes){per_gpu(profile)}, "
        + (
            "use kv_cache_dtype fp8, lower max_model_len, or raise tensor_parallel_size (fewer KV heads and "
            "weights per GPU)"
            if profile.device == "cuda"
            else "use kv_cache_dtype fp8, or lower max_model_len"
        )
    )


def max_num_batched_tokens(profile: EngineProfile) -> int | None:
    """The step token budget the engine runs with: the profile's, else vLLM's default where that is fixed
    (chunked prefill on; without it vLLM widens the budget to the longest sequence)."""
    if profile.max_num_batched_tokens is not None or profile.enable_chunked_prefill is False:
        return profile.max_num_batched_tokens
    default = DEFAULT_MAX_NUM_BATCHED_TOKENS[profile.device]
    # vLLM's CPU default is per rank of one engine (TP x PP), as platform.DEFAULT_MAX_NUM_BATCHED_TOKENS says.
    return (
        None if default is None else default * profile.tensor_parallel_size * profile.pipeline_parallel_size
    )
