"""A profile on the host that runs it: whether this host can keep its KV dtype and thread placement, and
the profile it really runs (an fp8 KV cache falls back where vLLM's CPU build cannot keep it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtune import kv_math, platform
from kvtune.config_errors import brief
from kvtune.kv_math import is_fp8
from kvtune.platform import (
    CPU_BIND_MODES,
    cpu_bind_host_problem,
    cpu_fp8_kv_problem,
    cpu_reserve_host_problem,
    detect_device,
    format_core_ids,
    parse_core_lists,
)

if TYPE_CHECKING:
    from kvtune.profile.model import EngineProfile


def kv_dtype_problem(profile: EngineProfile) -> str | None:
    """Why this host cannot keep the fp8 KV cache (only CPU profiles on CPU hosts are checked)."""
    if profile.device != "cpu" or not is_fp8(profile.kv_cache_dtype) or detect_device() != "cpu":
        return None
    geometry = kv_math.lookup_geometry(profile.model)
    return cpu_fp8_kv_problem(geometry.head_dim if geometry else None)


def adapted(profile: EngineProfile) -> tuple[EngineProfile, str | None]:
    """The profile this host will really run, and a note when the KV dtype fell back."""
    problem = kv_dtype_problem(profile)
    if problem is None or profile.kv_cache_dtype_fallback is None:
        return profile, None
    fallback = profile.kv_cache_dtype_fallback
    note = f"kv_cache_dtype {profile.kv_cache_dtype} -> {fallback}: {problem}"
    return profile.model_copy(update={"kv_cache_dtype": fallback, "kv_cache_dtype_fallback": None}), note


def threads_bind_problem(value: str) -> str | None:
    """Why VALUE is not a thread binding vLLM's CPU build reads; None when it is."""
    if value in CPU_BIND_MODES:
        return None
    try:
        parse_core_lists(value)
    except ValueError as exc:
        return (
            f"{brief(value)} is not a thread binding vLLM reads: {exc}; use auto, nobind, or core ids such "
            "as 0-1 or 0,2-3 (one list per rank, joined by '|')"
        )
    return None


def cpu_ranks(profile: EngineProfile) -> int:
    """Worker processes vLLM's CPU build runs for the profile on this host: TP x PP per engine, and DP
    engines of them (each rank a core list of its own)."""
    return profile.tensor_parallel_size * profile.pipeline_parallel_size * profile.data_parallel_size


def ranks_text(profile: EngineProfile) -> str:
    """The parallel sizes that make the ranks, e.g. "tensor_parallel_size 2 x pipeline_parallel_size 2"."""
    sizes = {
        "tensor_parallel_size": profile.tensor_parallel_size,
        "pipeline_parallel_size": profile.pipeline_parallel_size,
        "data_parallel_size": profile.data_parallel_size,
    }
    return " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "one rank"


def threads_bind_ranks_problem(profile: EngineProfile) -> str | None:
    """Why an explicit cpu_threads_bind does not give one core list per rank, as vLLM's CPU build needs
    (it asserts at start-up otherwise); any host."""
    bind = profile.cpu_threads_bind
    if profile.device != "cpu" or bind is None or bind in CPU_BIND_MODES:
        return None
    lists, ranks = bind.count("|") + 1, cpu_ranks(profile)
    if lists == ranks:
        return None
    return (
        f"cpu_threads_bind {brief(bind)} gives {lists} core list{'s' if lists > 1 else ''} and "
        f"{ranks_text(profile)} makes {ranks} rank{'s' if ranks > 1 else ''}: vLLM needs one core list per "
        f"rank, joined by '|' (ranks ordered data, pipeline, tensor), e.g. {_example_bind(ranks)}; "
        "or use auto"
    )


def _example_bind(ranks: int, cores: frozenset[int] | None = None) -> str:
    """Core lists for RANKS ranks: the host's cores in equal shares, or 2 cores a rank from 0."""
    ids = sorted(cores) if cores else list(range(2 * ranks))
    share = max(len(ids) // ranks, 1)
    return "|".join(format_core_ids(frozenset(ids[i * share : (i + 1) * share])) for i in range(ranks))


def cpu_cores_problem(profile: EngineProfile) -> str | None:
    """Why this host's cores cannot take the profile's thread placement; checked only where vLLM's CPU
    build runs, so a CPU profile can still be rendered on any machine."""
    if profile.device != "cpu" or detect_device() != "cpu":
        return None
    problem = _ranks_on_host_problem(profile)
    if problem:
        return problem
    if profile.cpu_threads_bind is not None:
        problem = cpu_bind_host_problem(profile.cpu_threads_bind)
        if problem:
            return (
                f"cpu_threads_bind: {brief(profile.cpu_threads_bind)} cannot be used on this host: {problem}"
            )
    if profile.cpu_reserved_cores is not None:
        problem = cpu_reserve_host_problem(profile.cpu_reserved_cores)
        if problem:
            return f"cpu_reserved_cores: {problem}"
    return None


def _ranks_on_host_problem(profile: EngineProfile) -> str | None:
    """Why this host cannot run the profile's ranks: a core each, and under auto binding a NUMA node each."""
    ranks = cpu_ranks(profile)
    if ranks == 1:
        return None
    # Through the module: a test's fake host replaces these there.
    cores = platform.host_cpu_ids()
    if len(cores) < ranks:
        return (
            f"{ranks_text(profile)} makes {ranks} ranks, each computing on cores of its own, and this "
            f"process may run on {len(cores)} ({format_core_ids(cores)}); lower tensor_parallel_size, "
            "pipeline_parallel_size or data_parallel_size to at most "
            f"{len(cores)} ranks in all"
        )
    nodes = platform.host_memory_nodes()
    if profile.cpu_threads_bind in (None, "auto") and len(nodes) < ranks:
        return (
            f"cpu_threads_bind auto: vLLM's auto binding gives each of the {ranks} ranks of "
            f"{ranks_text(profile)} a NUMA node of its own, and this host has {len(nodes)}; set "
            f"cpu_threads_bind to one core list per rank, e.g. {_example_bind(ranks, cores)}"
        )
    return None
