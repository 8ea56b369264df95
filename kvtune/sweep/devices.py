"""Where each of `kvtune sweep --parallel N`'s trials runs: N disjoint device slots, planned before anything
starts.

On CUDA a slot is `tensor x pipeline x data parallel size` GPUs (the engine sees them through
CUDA_VISIBLE_DEVICES); the GPUs are counted by the driver through NVML (nvidia-ml-py) or, without it, by
torch's CUDA runtime, never by parsing a command's output. On vLLM's CPU build a slot is an equal share of
the cores this process may run on, each at least one core per rank: the trial's engine binds its compute
threads there and the worker (with its load generator) is pinned to the same cores, so trials that share the
host do not share cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from kvtune.config_errors import ConfigError
from kvtune.platform import format_core_ids, host_cpu_ids, parse_core_lists
from kvtune.profile import EngineProfile


@dataclass(frozen=True)
class Slot:
    """The devices one trial at a time uses: cores (cpu) or GPU indices (cuda)."""

    cores: frozenset[int] = frozenset()
    gpus: tuple[int, ...] = ()

    def describe(self) -> str:
        return (
            f"GPUs {','.join(map(str, self.gpus))}" if self.gpus else f"cores {format_core_ids(self.cores)}"
        )

    def as_flag(self) -> str:
        """The slot as a worker is told it (`--devices`)."""
        return (
            f"gpus:{','.join(map(str, self.gpus))}" if self.gpus else f"cores:{format_core_ids(self.cores)}"
        )

    @classmethod
    def from_flag(cls, text: str) -> Slot:
        kind, _, ids = text.partition(":")
        try:
            if kind == "gpus" and ids:
                return cls(gpus=tuple(int(i) for i in ids.split(",")))
            if kind == "cores" and ids and "|" not in ids:
                (ranges,) = parse_core_lists(ids)
                return cls(cores=frozenset(c for first, last in ranges for c in range(first, last + 1)))
        except ValueError:
            pass
        raise ConfigError(f"--devices {text}: give cores:0-1 or gpus:0,1")

    def placed(self, profile: EngineProfile) -> EngineProfile:
        """PROFILE running on this slot only."""
        if self.gpus:
            return profile.model_copy(
                update={"env": profile.env | {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus))}}
            )
        ranks = _ranks(profile)
        cores = sorted(self.cores)
        share = len(cores) // ranks
        lists = [format_core_ids(frozenset(cores[i * share : (i + 1) * share])) for i in range(ranks)]
        return profile.model_copy(update={"cpu_threads_bind": "|".join(lists), "cpu_reserved_cores": None})

    def pin_this_process(self) -> None:
        """This worker and what it starts (its load generator) on the slot's cores only."""
        if self.cores:
            os.sched_setaffinity(0, self.cores)


def _ranks(profile: EngineProfile) -> int:
    return profile.tensor_parallel_size * profile.pipeline_parallel_size * profile.data_parallel_size


def cuda_device_count() -> int:
    """GPUs the CUDA driver shows this process: NVML when installed, else torch's CUDA runtime."""
    try:
        import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py, on GPU hosts
    except ImportError:
        import torch

        return int(torch.cuda.device_count())
    try:
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError:
        return 0


# Knobs a CPU slot sets itself: a space that varies them would measure the slot's binding, not the knob.
SLOT_KNOBS = ("cpu_threads_bind", "cpu_reserved_cores")


def plan_slots(
    profile: EngineProfile,
    parallel: int,
    *,
    knobs: tuple[str, ...] = (),
    cores: frozenset[int] | None = None,
    gpu_count: Callable[[], int] = cuda_device_count,
) -> list[Slot]:
    """PARALLEL disjoint slots for trials of PROFILE (whose sweep varies KNOBS); ConfigError naming --parallel
    and what is there."""
    if parallel < 1:
        raise ConfigError(f"--parallel {parallel}: give 1 or more trials at once")
    clashing = [knob for knob in SLOT_KNOBS if knob in knobs]
    if profile.device == "cpu" and clashing:
        raise ConfigError(
            f"--parallel {parallel}: each trial's engine is bound to its own cores, so the space's "
            f"{', '.join(clashing)} would not be measured; remove it from the space, or run one trial at "
            "a time"
        )
    ranks = _ranks(profile)
    if profile.device == "cuda":
        found = gpu_count()
        visible = _visible_gpus(found)
        if parallel * ranks > len(visible):
            most = len(visible) // ranks
            raise ConfigError(
                f"--parallel {parallel}: each trial's engine needs {ranks} GPU(s) (tensor x pipeline x data "
                f"parallel size) and {len(visible)} are visible here ({found} found by the driver); at most "
                f"--parallel {most}" + ("" if most else ": use a host with more GPUs")
            )
        return [Slot(gpus=tuple(visible[i * ranks : (i + 1) * ranks])) for i in range(parallel)]
    available = sorted(cores if cores is not None else host_cpu_ids())
    share = len(available) // parallel
    if share < ranks:
        most = len(available) // ranks
        raise ConfigError(
            f"--parallel {parallel}: each trial's engine needs {ranks} core(s) (one per rank) and this "
            f"process may run on {len(available)} ({format_core_ids(frozenset(available))}); at most "
            f"--parallel {most}"
        )
    return [Slot(cores=frozenset(available[i * share : (i + 1) * share])) for i in range(parallel)]


def _visible_gpus(found: int) -> list[int]:
    """The GPU indices this process may use: CUDA_VISIBLE_DEVICES' order when it is set (its entries
    renumbered from 0, as CUDA does), else every GPU found."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(found))
    entries = [entry for entry in visible.split(",") if entry.strip()]
    return list(range(min(len(entries), found)))


def share_note(slots: list[Slot]) -> str | None:
    """What the report says of trials that shared the host; None for one at a time."""
    if len(slots) < 2:
        return None
    split = "; ".join(slot.describe() for slot in slots)
    if slots[0].gpus:
        return f"trials ran {len(slots)} at a time, each on its own GPUs ({split})"
    return (
        f"trials ran {len(slots)} at a time on this host's cores, each engine and its load generator on its "
        f"own share ({split}): absolute rates are per share of the host, comparable between trials; the "
        "winner was validated alone, on every core"
    )
