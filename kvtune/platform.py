"""Which vLLM build this machine runs (CPU or CUDA), and the vLLM behaviour kvtune relies on.

vLLM's rules restated as constants live here and only here, each with the vLLM version and the place it
was read from, so that a vLLM upgrade has one module to check. The dtypes themselves are in `kv_math`.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
from importlib import metadata
from pathlib import Path
from typing import Literal

from kvtune.config_errors import brief
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

# The step token budget when a profile leaves max_num_batched_tokens unset, with chunked prefill, for the
# API server: CPU 2,048 per rank (vLLM 0.32.0, vllm/engine/arg_utils.py `get_batch_defaults`). On CUDA it
# depends on the GPU's memory and kind, so it is not restated.
DEFAULT_MAX_NUM_BATCHED_TOKENS: dict[Device, int | None] = {"cpu": 2048, "cuda": None}

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

# vLLM's CPU build cannot load its own AOT compile artefacts: with VLLM_USE_AOT_COMPILE on (its default with
# torch >= 2.10), every start logs "Compiling model again due to a load failure ... 'function' object has no
# attribute 'finalize_loading'" and compiles from scratch (vLLM 0.32.0, vllm/compilation/decorators.py). Off,
# torch.compile's own Inductor cache serves every later start of the model, whatever its batch limits or
# cores: measured 150 s for the first compiled start of SmolLM2 on a 2-core host, 60-70 s for the next ones
# (110 s with AOT on). CPU engines get it off unless their profile's env says otherwise.
CPU_COMPILE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}

# How vLLM's CPU build places its compute (OpenMP) threads (vLLM 0.32.0, vllm/envs.py and
# vllm/utils/ompmultiprocessing.py `OMPProcessManager`). VLLM_CPU_OMP_THREADS_BIND is "auto" (the default:
# vLLM picks the cores it may run on, one logical CPU per physical core), "nobind", or core ids read by
# cpu_resource_utils.parse_id_list ("0-1", "0,2-3"), one list per rank joined by "|".
# VLLM_CPU_NUM_OF_RESERVED_CPU is read in auto mode only: the cores kept back for the API server and
# scheduler (default: the local world size); when they leave none to compute on, vLLM warns and keeps none.
CPU_THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
CPU_RESERVED_CORES_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
CPU_BIND_MODES = ("auto", "nobind")
_CORE_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")

CoreRange = tuple[int, int]


# vLLM's CPU build runs one worker process per rank of an engine (TP x PP; with data parallelism, DP engines
# of TP x PP each on the host). Auto binding gives each rank a NUMA memory node of its own and refuses to
# start with fewer ("Not enough allowed NUMA nodes", vLLM 0.32.0, vllm/utils/ompmultiprocessing.py
# `_get_autobind_cpu_ids`); it reads the nodes from /proc/self/status Mems_allowed_list
# (vllm/utils/cpu_resource_utils.py `get_memory_affinity`). An explicit binding gives one core list per
# rank, ranks ordered DP, PP, TP (`_parse_omp_threads_bind_env`).
_STATUS = Path("/proc/self/status")


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


@functools.cache
def host_cpu_ids() -> frozenset[int]:
    """The core ids this process may run on (its affinity, which cgroups and taskset narrow), as vLLM's
    auto binding reads them."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux: every core
        return frozenset(range(os.cpu_count() or 1))


@functools.cache
def host_memory_nodes() -> frozenset[int]:
    """The NUMA memory nodes this process may allocate on, as vLLM's auto binding reads them ({0} when the
    host does not say)."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return frozenset({0})
    for line in text.splitlines():
        if line.startswith("Mems_allowed_list:"):
            ranges = [_core_range(part) for part in line.split(":", 1)[1].strip().split(",")]
            nodes = {node for r in ranges if r for node in range(r[0], r[1] + 1)}
            return frozenset(nodes) or frozenset({0})
    return frozenset({0})


def format_core_ids(cores: frozenset[int]) -> str:
    """Core ids the way VLLM_CPU_OMP_THREADS_BIND writes them: {0, 1, 2, 5} -> "0-2,5"."""
    parts: list[str] = []
    for core in sorted(cores):
        if parts and core - 1 in cores:
            parts[-1] = f"{parts[-1].split('-')[0]}-{core}"
        else:
            parts.append(str(core))
    return ",".join(parts)


def _core_range(part: str) -> CoreRange | None:
    """ "N" or "N-M" with M >= N as (N, M); None for anything else."""
    match = _CORE_RANGE.fullmatch(part)
    if not match:
        return None
    try:
        first, last = int(match[1]), int(match[2] or match[1])
    except ValueError:  # more digits than Python converts: no core has such an id
        return None
    return (first, last) if last >= first else None


def parse_core_lists(bind: str) -> list[list[CoreRange]]:
    """An explicit VLLM_CPU_OMP_THREADS_BIND as (first, last) core ranges, one list per rank: "0-1|2,4" ->
    [[(0, 1)], [(2, 2), (4, 4)]]. Ranges stay unexpanded, so "0-999999999" costs nothing. ValueError names
    the part vLLM could not read."""
    lists: list[list[CoreRange]] = []
    for rank, text in enumerate(bind.split("|")):
        ranges: list[CoreRange] = []
        for part in text.split(","):
            core_range = _core_range(part)
            if core_range is None:
                where = f" in rank {rank}'s list" if "|" in bind else ""
                what = "it" if part == bind else f"{brief(part)}{where}"
                raise ValueError(f"{what} is neither a core id N nor a range N-M with M >= N")
            ranges.append(core_range)
        lists.append(ranges)
    return lists


def bound_cores(bind: str | None) -> frozenset[int] | None:
    """The host cores an explicit VLLM_CPU_OMP_THREADS_BIND names, every rank's; None for no bind or a mode
    (auto, nobind), where vLLM places the threads itself."""
    if bind is None or bind in CPU_BIND_MODES:
        return None
    ranges = [core_range for ranks in parse_core_lists(bind) for core_range in ranks]
    # The host's cores, not the ranges expanded: a range is checked against the host, never materialised.
    return frozenset(core for core in host_cpu_ids() if any(first <= core <= last for first, last in ranges))


def cpu_bind_host_problem(bind: str) -> str | None:
    """Why this host cannot run vLLM's compute threads on the cores `bind` names, or None when it can."""
    if bind in CPU_BIND_MODES:
        return None
    cores = host_cpu_ids()
    lacking = [
        str(first) if first == last else f"{first}-{last}"
        for ranks in parse_core_lists(bind)
        for first, last in ranks
        if sum(first <= core <= last for core in cores) < last - first + 1
    ]
    if not lacking:
        return None
    allowed = format_core_ids(cores)
    return (
        f"this process may run only on cores {allowed}, not on all of {', '.join(lacking)}; bind only cores "
        f"among {allowed}, or use auto"
    )


def cpu_reserve_host_problem(reserved: int) -> str | None:
    """Why keeping `reserved` cores for the API server leaves vLLM none to compute on, or None."""
    cores = host_cpu_ids()
    if reserved < len(cores):
        return None
    return (
        f"{reserved} reserved cores leave none of the {len(cores)} this process may run on "
        f"({format_core_ids(cores)}) for vLLM's compute threads (vLLM would then warn and reserve none); "
        f"reserve at most {len(cores) - 1} (0 computes on every core)"
    )


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


def is_loopback(host: str) -> bool:
    """HOST names this machine's loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
