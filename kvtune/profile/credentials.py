"""A profile's credentials: the API key and the secret_env values, read from the environment or a file at
launch, never stored, logged or rendered; and the checks that keep them out of env and extra_args."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvtune.config_errors import ConfigError
from kvtune.credentials import looks_secret, posix_name_problem, value_looks_secret
from kvtune.documents import read_text
from kvtune.profile.rendering import VLLM_API_KEY_ENV, engine_env

if TYPE_CHECKING:
    from kvtune.profile.model import EngineProfile

API_KEY_FILE_BYTES = 64 * 1024


def env_problem(name: str, value: str, managed_problem: str | None) -> str | None:
    """Why NAME=VALUE may not be in a profile's env (written to every output); None when it may."""
    problem = posix_name_problem(name)
    if problem:
        return f"env: {problem}"
    if managed_problem:
        return f"env.{name}: {managed_problem}"
    if looks_secret(name) or value_looks_secret(value):
        return (
            f"env.{name}: looks like a credential, and env values are written to every output "
            f"(best.yaml, vllm-serve.sh, kvtune render); remove it from env, list {name} under "
            "secret_env and set it in the environment kvtune runs in"
        )
    if "\0" in value:
        return f"env.{name}: the value holds a NUL character, which no environment can"
    return None


def api_key(profile: EngineProfile) -> str | None:
    """The API key clients must send, from the variable or file the profile names; None without one."""
    if profile.api_key_env:
        key = os.environ.get(profile.api_key_env, "").strip()
        if not key:
            raise ConfigError(
                f"engine {profile.name!r}: api_key_env: the environment variable {profile.api_key_env} is "
                "not set or empty; export it with the engine's API key"
            )
        return key
    if profile.api_key_file:
        try:
            # A key is a line; a larger file is not one (and is not read whole into memory).
            text = read_text(Path(profile.api_key_file), "a file holding the key", limit=API_KEY_FILE_BYTES)
        except ConfigError as exc:
            raise ConfigError(f"engine {profile.name!r}: api_key_file: {exc}") from None
        lines = text.splitlines()
        if not lines or not lines[0].strip():
            raise ConfigError(
                f"engine {profile.name!r}: api_key_file {profile.api_key_file} is empty; put the key on its "
                "first line"
            )
        return lines[0].strip()
    return None


def secret_values(profile: EngineProfile) -> dict[str, str]:
    """The `secret_env` variables from this process's environment; ConfigError naming a missing one."""
    missing = [name for name in profile.secret_env if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"engine {profile.name!r}: secret_env: {', '.join(missing)} not set in the environment; "
            "export it before starting (its value is never written by kvtune)"
        )
    return {name: os.environ[name] for name in profile.secret_env}


def launch_env(profile: EngineProfile) -> dict[str, str]:
    """What the engine process gets on top of the caller's environment: the rendered env, the secrets and
    the API key (vLLM reads VLLM_API_KEY), so no credential is ever on its command line."""
    key = api_key(profile)
    return engine_env(profile) | secret_values(profile) | ({VLLM_API_KEY_ENV: key} if key else {})
