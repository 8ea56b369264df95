"""What a profile renders: vLLM's options, argv, a `vllm serve` config, a runnable sh script, the engine's
environment and the profile itself as YAML. The flags come from each field's FieldFacts."""

from __future__ import annotations

import json
import shlex
import sys
from typing import TYPE_CHECKING, Any

from kvtune.documents import dump_yaml
from kvtune.platform import CPU_COMPILE_ENV, is_loopback
from kvtune.profile.fields import env_options, flag_options

if TYPE_CHECKING:
    from kvtune.profile.model import EngineProfile

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM reads its API key from this variable (vllm/envs.py, 0.32): kvtune passes it so, never on argv.
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def vllm_options(profile: EngineProfile, model_path: str | None = None) -> dict[str, Any]:
    """vLLM server options by their flag names; the one mapping argv and serve YAML are rendered from."""
    options = flag_options(profile)
    if model_path:
        options["model"] = model_path
    return options


def kv_events_config(profile: EngineProfile) -> str | None:
    """vLLM's --kv-events-config: events sent to host:kv_events_port (vLLM connects to an explicit address
    and binds only wildcards; the router binds it, on loopback by default)."""
    if profile.kv_events_port is None:
        return None
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{profile.host}:{profile.kv_events_port}",
        "topic": f"kv@{profile.name}",
    }
    if (replay := kv_events_replay_endpoint(profile)) is not None:
        config["replay_endpoint"] = replay
    return json.dumps(config, separators=(",", ":"))


def kv_events_replay_endpoint(profile: EngineProfile) -> str | None:
    """Where vLLM serves PROFILE's KV-event replay (it binds exactly this): loopback for an engine on
    loopback or on every interface, since the batches carry prompts' token ids; the engine's own address
    otherwise."""
    if profile.kv_events_replay_port is None:
        return None
    wildcard = profile.host == "0.0.0.0"  # noqa: S104 (compared, not bound)
    host = "127.0.0.1" if wildcard or is_loopback(profile.host) else profile.host
    return f"tcp://{host}:{profile.kv_events_replay_port}"


def vllm_args(profile: EngineProfile, model_path: str | None = None) -> list[str]:
    args: list[str] = []
    for flag, value in vllm_options(profile, model_path).items():
        if value is True:
            args.append(f"--{flag}")
        elif value is False:
            args.append(f"--no-{flag}")
        else:
            args += [f"--{flag}", _word(value)]
    return args + list(profile.extra_args)


def _word(value: Any) -> str:
    """A flag's value as one word: a whole float without its ".0" (64, not 64.0), as the chart's template
    writes it, so the pod runs the command `kvtune render` prints."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def argv(profile: EngineProfile, model_path: str | None = None, python: str = sys.executable) -> list[str]:
    return [python, "-m", API_SERVER_MODULE, *vllm_args(profile, model_path)]


def serve_yaml(profile: EngineProfile, model_path: str | None = None) -> str:
    """A `vllm serve --config` file: the model and extra_args go on the command line (its header says
    which), the rest in the file."""
    options = vllm_options(profile, model_path)
    model = options.pop("model")
    # extra_args stay on the command line: the file holds settings, they are flags as vLLM reads them.
    extra = "".join(f" {shlex.quote(arg)}" for arg in profile.extra_args)
    header = f"# vllm serve {shlex.quote(str(model))} --config THIS_FILE{extra}\n"
    return header + dump_yaml(options)


def engine_env(profile: EngineProfile) -> dict[str, str]:
    """The environment the engine runs with on top of the caller's: the CPU build's settings, the fields
    that set variables, then the profile's own env."""
    env: dict[str, str] = (
        {"VLLM_TARGET_DEVICE": profile.device} | CPU_COMPILE_ENV if profile.device == "cpu" else {}
    )
    return env | env_options(profile) | profile.env


def launch_command(
    profile: EngineProfile, model_path: str | None = None, python: str = sys.executable
) -> list[str]:
    """The engine's command as a shell runs it: `env NAME=value ... python -m vllm... --flags`.

    The module form works on vLLM's CPU build too, whose `vllm` console script cannot start; secrets are
    not in it (they come from the environment, see `serve_script`).
    """
    env = [f"{name}={value}" for name, value in engine_env(profile).items()]
    return (["env", *env] if env else []) + argv(profile, model_path, python)


def serve_script(
    profile: EngineProfile, model_path: str | None = None, comments: list[str] | None = None
) -> str:
    """A POSIX sh script that starts this engine: every word quoted, credentials taken from the caller's
    environment at run time (and refused with a message when missing), never written into the file."""
    lines = ["#!/bin/sh", *("# " + " ".join(line.splitlines()) for line in comments or [])]
    if model_path and model_path != profile.model:
        lines.append("# model " + " ".join(f"{profile.model!r} is served from {model_path}".splitlines()))
    lines.append("set -eu")
    for name in profile.secret_env:
        lines.append(f': "${{{name}:?set {name} in the environment (the profile lists it in secret_env)}}"')
    if profile.api_key_env:
        lines.append(
            f'{VLLM_API_KEY_ENV}="${{{profile.api_key_env}:?set {profile.api_key_env} to the API key clients '
            f'send (api_key_env)}}"'
        )
    elif profile.api_key_file:
        lines.append(f'{VLLM_API_KEY_ENV}="$(head -n 1 {shlex.quote(str(profile.api_key_file))})"')
    if profile.api_key_env or profile.api_key_file:
        lines.append(f"export {VLLM_API_KEY_ENV}")
    lines.append(f"exec {shlex.join(launch_command(profile, model_path))}")
    return "\n".join(lines) + "\n"


def to_yaml(profile: EngineProfile, header: str = "") -> str:
    """The profile as a YAML file `kvtune up` accepts (unset fields left out, paths absolute)."""
    data = profile.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    data = {"name": profile.name, "device": profile.device, "model": profile.model} | data
    return header + dump_yaml(data)
