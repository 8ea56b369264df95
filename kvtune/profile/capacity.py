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


def kv_budget_bytes(profile: EngineProfile, geometry: kv_math.ModelGeometry) -> tuple[int, str] | None:
    """The KV pool in bytes and how it was derived, when the profile fixes it; None for vLLM's default."""
    if profile.kv_cache_memory_bytes is not None:
        return int(profile.kv_cache_memory_bytes), f"kv_cache_memory_bytes {profile.kv_cache_memory_bytes:,}"
    if profile.gpu_memory_utilization is not None and profile.accelerator_memory_gib is not None:
        total = profile.accelerator_memory_gib * kv_math.GIB
        weights = geometry.num_params * kv_math.MODEL_DTYPE_BYTES[profile.dtype]
        kv = int(total * profile.gpu_memory_utilization - weights)
        return kv, (
            f"gpu_memory_utilization {profile.gpu_memory_utilization} x {profile.accelerator_memory_gib} GiB"
            f" - {kv_math.format_bytes(weights)} weights = at most {kv_math.format_bytes(kv)}"
        )
    return None


def kv_capacity_tokens(profile: EngineProfile) -> int | None:
    """Tokens the KV pool holds by arithmetic, when model geometry and budget are both known."""
    geometry = kv_math.lookup_geometry(profile.model)
    budget = geometry and kv_budget_bytes(profile, geometry)
    if not geometry or not budget:
        return None
    per_token = geometry.kv_bytes_per_token(profile.kv_cache_dtype, profile.dtype)
    return kv_math.kv_tokens(
        max(budget[0], 0), per_token, block_size(profile), profile.num_gpu_blocks_override
    )


def usable_kv_tokens(profile: EngineProfile) -> int | None:
    """Tokens requests can use: vLLM keeps one block of the pool back (its null block)."""
    capacity = kv_capacity_tokens(profile)
    return None if capacity is None else tokens_after_null_block(capacity, block_size(profile))


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
    per_token = geometry.kv_bytes_per_token(profile.kv_cache_dtype, profile.dtype)
    cap = ""
    if profile.num_gpu_blocks_override is not None:
        cap = f", capped at num_gpu_blocks_override {profile.num_gpu_blocks_override} blocks"
    needed = seq_len * per_token
    return (
        f"the KV budget leaves {capacity:,} usable tokens (one block is vLLM's), fewer than one "
        f"max_model_len sequence of {seq_len:,}: "
        f"{budget[1]} / ({geometry.explain_bytes_per_token(profile.kv_cache_dtype, profile.dtype)})"
        f" in blocks of {block_size(profile)}{cap}; "
        f"raise the budget to at least {kv_math.format_bytes(needed)} ({needed:,} bytes), "
        f"use kv_cache_dtype fp8, or lower max_model_len"
    )


def max_num_batched_tokens(profile: EngineProfile) -> int | None:
    """The step token budget the engine runs with: the profile's, else vLLM's default where that is fixed
    (chunked prefill on; without it vLLM widens the budget to the longest sequence)."""
    if profile.max_num_batched_tokens is not None or profile.enable_chunked_prefill is False:
        return profile.max_num_batched_tokens
    return DEFAULT_MAX_NUM_BATCHED_TOKENS[profile.device]
