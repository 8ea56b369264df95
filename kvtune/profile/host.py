"""A profile on the host that runs it: whether this host can keep its KV dtype and thread placement, and
the profile it really runs (an fp8 KV cache falls back where vLLM's CPU build cannot keep it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtune import kv_math
from kvtune.config_errors import brief
from kvtune.kv_math import is_fp8
from kvtune.platform import (
    CPU_BIND_MODES,
    cpu_bind_host_problem,
    cpu_fp8_kv_problem,
    cpu_reserve_host_problem,
    detect_device,
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


def cpu_cores_problem(profile: EngineProfile) -> str | None:
    """Why this host's cores cannot take the profile's thread placement; checked only where vLLM's CPU
    build runs, so a CPU profile can still be rendered on any machine."""
    if profile.device != "cpu" or detect_device() != "cpu":
        return None
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
