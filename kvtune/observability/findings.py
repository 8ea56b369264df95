"""What `kvtune doctor` says: one judged fact per check, and the advice several checks end in, how to grow
the KV pool in the profile field that sizes it now, written once so every check names the same field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtune import metrics
from kvtune.kv_math import KvBytes, label_int, mib

Level = Literal["ok", "warn"]


@dataclass(frozen=True)
class Finding:
    """One judged fact: `check` is a stable id, `arithmetic` the figures behind the text."""

    check: str
    level: Level
    text: str
    arithmetic: str = ""


def seconds(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def percent(value: float) -> str:
    return f"{value:.1%}"


def pool_fix(
    capacity: metrics.KvCapacity, cache: dict[str, str], kv: KvBytes, target_blocks: int, basis: str = ""
) -> tuple[str, list[str]]:
    """How to give the pool at least `target_blocks` blocks, and the arithmetic: the block cap when one
    sizes the pool (a larger byte budget would change nothing), else the byte budget (per GPU when `basis`
    says so), else the size in tokens when the model's bytes per token are unknown."""
    on = f" {basis}" if basis else ""
    override = label_int(cache, "num_gpu_blocks_override")
    if override is not None:
        cap = f"num_gpu_blocks_override {override:,} caps the pool at {override:,} blocks whatever its budget"
        return f"raise num_gpu_blocks_override from {override:,} to at least {target_blocks:,}", [cap]
    if kv.per_token is None:
        tokens = target_blocks * capacity.block_size
        return (
            f"grow the KV pool to at least {tokens:,} tokens ({target_blocks:,} blocks)",
            [f"its size in bytes needs the model's KV bytes per token, unknown here: {kv.how}"],
        )
    target = target_blocks * capacity.block_size * kv.per_token
    explicit = label_int(cache, "kv_cache_memory_bytes")
    if explicit:
        fix = f"raise kv_cache_memory_bytes from {mib(explicit)} to at least {mib(target)}{on}"
    else:
        utilization = cache.get("gpu_memory_utilization", "?")
        fix = (
            f"set kv_cache_memory_bytes to at least {mib(target)}{on} (gpu_memory_utilization "
            f"{utilization} sizes the pool now)"
        )
    line = (
        f"{target_blocks:,} blocks x {capacity.block_size} tokens x {kv.per_token:,} bytes/token{on} = "
        f"{target:,} bytes = {mib(target)} ({kv.how})"
    )
    return fix, [line]
