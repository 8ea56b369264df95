"""Several engines behind one router: replicas expanded into engines, and what they must share.

One profile with `replicas: N` stands for N engines: replica i is named NAME-i, listens on port + i
(KV events on kv_events_port + i, their replay on kv_events_replay_port + i) and, on CPU, computes on its
own equal share of the host's cores (no core kept back: each engine's API server shares its engine's
cores); on CUDA it sees GPU i only. Every engine behind a router must serve the same model under the same
name with the same block size, or one prompt's blocks would mean different things on different engines.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtune.config_errors import ConfigError
from kvtune.platform import format_core_ids, host_cpu_ids
from kvtune.profile import EngineProfile


def expand_replicas(profile: EngineProfile, cores: frozenset[int] | None = None) -> list[EngineProfile]:
    """The engines PROFILE stands for (itself when replicas is 1)."""
    if profile.replicas == 1:
        return [profile]
    count = profile.replicas
    if profile.device == "cpu":
        if profile.cpu_threads_bind not in (None, "auto"):
            raise ConfigError(
                f"engine {profile.name!r}: replicas {count} with cpu_threads_bind "
                f"{profile.cpu_threads_bind!r}: kvtune gives each replica its own cores; remove "
                "cpu_threads_bind"
            )
        available = sorted(cores if cores is not None else host_cpu_ids())
        if len(available) < count:
            raise ConfigError(
                f"engine {profile.name!r}: replicas {count} need a core each and this host has "
                f"{len(available)}; lower replicas"
            )
        share = len(available) // count
    replicas = []
    for index in range(count):
        update: dict[str, object] = {
            "name": f"{profile.name}-{index}",
            "port": profile.port + index,
            "replicas": 1,
        }
        for field in ("kv_events_port", "kv_events_replay_port"):
            if (first := getattr(profile, field)) is not None:
                update[field] = first + index
        if profile.device == "cpu":
            own = frozenset(available[index * share : (index + 1) * share])
            update |= {"cpu_threads_bind": format_core_ids(own), "cpu_reserved_cores": None}
        else:
            update["env"] = profile.env | {"CUDA_VISIBLE_DEVICES": str(index)}
        replicas.append(profile.model_copy(update=update))
    return replicas


def check_fleet(profiles: Sequence[EngineProfile]) -> None:
    """ConfigError unless the engines can share one router (same model name, block size and API key)."""
    first = profiles[0]
    for profile in profiles[1:]:
        if profile.api_key() != first.api_key():
            raise ConfigError(
                f"engines {first.name!r} and {profile.name!r} take different API keys (or one takes none): "
                "the router checks one key for all; give them the same api_key_env or api_key_file"
            )
        if profile.api_model_name != first.api_model_name:
            raise ConfigError(
                f"engines {first.name!r} and {profile.name!r} serve {first.api_model_name!r} and "
                f"{profile.api_model_name!r}: a router serves one model; give them the same served_model_name"
            )
        if profile.effective_block_size != first.effective_block_size:
            raise ConfigError(
                f"engines {first.name!r} and {profile.name!r} use blocks of {first.effective_block_size} and "
                f"{profile.effective_block_size} tokens: the router matches prefixes in one block size; "
                "set the same block_size"
            )
