"""What a pool of a given size costs a profile's engine, and the settings that give it.

A pool of C usable blocks is C + 1 blocks to vLLM (it keeps one back, its null block), each of `block_size`
tokens at the profile's KV bytes per token on one GPU (per rank under tensor and pipeline parallelism, where
every rank holds the same tokens). The settings that make it: `num_gpu_blocks_override: C + 1`, or
`kv_cache_memory_bytes` of exactly those blocks, or on a GPU whose memory the profile states,
`gpu_memory_utilization` covering the weights' share and the pool (a floor: vLLM also needs room for
activations, which only a start measures).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtune import kv_math
from kvtune.platform import NULL_BLOCKS
from kvtune.profile import EngineProfile
from kvtune.profile import capacity as profile_capacity


@dataclass(frozen=True)
class PoolCost:
    """One pool size in blocks, tokens, bytes and the profile settings that give it."""

    usable_blocks: int
    tokens: int
    num_gpu_blocks_override: int
    kv_cache_memory_bytes: int | None  # per GPU; None when the model's geometry is unknown
    gpu_memory_utilization: float | None  # only on a GPU whose memory the profile states
    fp8_bytes: int | None  # the same pool with an 8-bit KV cache, when the profile's is not one


@dataclass(frozen=True)
class PoolPricing:
    """How a profile prices pools: its block size, KV bytes per token and (on a GPU) memory."""

    block_size: int
    bytes_per_token: int | None
    how: str  # the bytes-per-token arithmetic, or why it is unknown
    fp8_bytes_per_token: int | None
    weights_bytes: int | None  # one GPU's share
    accelerator_bytes: float | None
    current_usable_blocks: int | None  # the profile's own pool, by arithmetic
    per_gpu: str

    def cost(self, usable_blocks: int) -> PoolCost:
        blocks = usable_blocks + NULL_BLOCKS
        tokens = blocks * self.block_size
        memory = None if self.bytes_per_token is None else tokens * self.bytes_per_token
        utilization = None
        if memory is not None and self.weights_bytes is not None and self.accelerator_bytes:
            utilization = (self.weights_bytes + memory) / self.accelerator_bytes
        fp8 = None if self.fp8_bytes_per_token is None else tokens * self.fp8_bytes_per_token
        return PoolCost(usable_blocks, usable_blocks * self.block_size, blocks, memory, utilization, fp8)


def pricing(profile: EngineProfile) -> PoolPricing:
    """PROFILE's pool arithmetic (as this host runs it: the caller adapts the profile first)."""
    block_size = profile.effective_block_size
    usable = profile.usable_kv_tokens()
    current = None if usable is None else usable // block_size
    geometry = kv_math.lookup_geometry(profile.model)
    if geometry is None:
        return PoolPricing(
            block_size, None, f"the geometry of {profile.model} is unknown", None, None, None, current, ""
        )
    tp, pp = profile.tensor_parallel_size, profile.pipeline_parallel_size
    per_token = profile_capacity.kv_bytes_per_token(profile, geometry)
    fp8 = None if kv_math.is_fp8(profile.kv_cache_dtype) else geometry.kv_bytes_per_token("fp8", tp=tp, pp=pp)
    on_gpu = profile.device == "cuda" and profile.accelerator_memory_gib is not None
    return PoolPricing(
        block_size,
        per_token,
        geometry.explain_bytes_per_token(profile.kv_cache_dtype, profile.dtype, tp, pp),
        fp8,
        geometry.weight_bytes_per_rank(profile.dtype, tp, pp) if on_gpu else None,
        (profile.accelerator_memory_gib or 0) * kv_math.GIB if on_gpu else None,
        current,
        profile_capacity.per_gpu(profile),
    )


def offload_blocks(offload_gib: float, pricing: PoolPricing, ranks: int) -> int | None:
    """Blocks a host-memory tier of OFFLOAD_GIB holds: vLLM's `--kv-offloading-size` is the total across the
    TP ranks, and each rank keeps its own share of every block."""
    if pricing.bytes_per_token is None:
        return None
    return int(offload_gib * kv_math.GIB // (ranks * pricing.bytes_per_token * pricing.block_size))
