"""Profiles: environment names checked, credentials named but never stored, managed flags not repeated,
and the rendered command and script quoted so nothing in a profile runs in a shell."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvtune.config_errors import ConfigError
from kvtune.credentials import looks_secret
from kvtune.helm.values import chart_values
from kvtune.profile import MANAGED_FLAGS, EngineProfile
from tests.helpers import default_profile_data

# Shell command substitution in an env value (backquotes: a profile refuses `$(`, which Kubernetes expands).
CHAINED = "`touch {marker}`X"


def profile(**overrides: Any) -> EngineProfile:
    return EngineProfile.model_validate(default_profile_data(**overrides))


def error_of(**overrides: Any) -> str:
    with pytest.raises(ValueError) as caught:
        profile(**overrides)
    return str(caught.value)


@pytest.mark.parametrize("name", ["A=B", "$(touch /tmp/x)X", "1ST", ""])
def test_env_keys_must_be_posix_names(name: str) -> None:
    message = error_of(env={name: "1"})
    assert "is not an environment variable name" in message and repr(name) in message


@pytest.mark.parametrize("name", ["HF_TOKEN", "VLLM_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"])
def test_credentials_in_env_are_refused_and_pointed_at_secret_env(name: str) -> None:
    message = error_of(env={name: "s3cret"})
    assert f"env.{name}: looks like a credential" in message
    assert f"list {name} under secret_env" in message


def test_ordinary_names_are_not_taken_for_credentials() -> None:
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "KEYBOARD"):
        assert not looks_secret(name), name


def test_secret_env_cannot_also_carry_a_value() -> None:
    message = error_of(env={"HF_HOME": "/x"}, secret_env=["HF_HOME"])
    assert "secret_env[0]: HF_HOME is also set in env" in message


def test_missing_credentials_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTUNE_TEST_KEY", raising=False)
    monkeypatch.delenv("KVTUNE_TEST_SECRET", raising=False)
    keyed = profile(api_key_env="KVTUNE_TEST_KEY")
    with pytest.raises(ConfigError, match="api_key_env: the environment variable KVTUNE_TEST_KEY is not set"):
        keyed.check_credentials()
    secret = profile(secret_env=["KVTUNE_TEST_SECRET"])
    with pytest.raises(ConfigError, match="secret_env: KVTUNE_TEST_SECRET not set in the environment"):
        secret.check_credentials()
    monkeypatch.setenv("KVTUNE_TEST_KEY", "k-123")
    monkeypatch.setenv("KVTUNE_TEST_SECRET", "s-456")
    assert keyed.launch_env()["VLLM_API_KEY"] == "k-123"
    assert secret.launch_env()["KVTUNE_TEST_SECRET"] == "s-456"


def test_api_key_file_is_read_at_launch_and_never_dumped(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k-789\n")
    keyed = profile(api_key_file=str(key_file))
    assert keyed.api_key() == "k-789"
    for rendered in (keyed.to_yaml(), keyed.serve_script(), keyed.serve_yaml(), str(chart_values(keyed))):
        assert "k-789" not in rendered
    assert " ".join(keyed.argv()).count("k-789") == 0
    key_file.write_text("")
    with pytest.raises(ConfigError, match="is empty; put the key on its first line"):
        keyed.api_key()
    assert "set only one of api_key_env or api_key_file" in error_of(
        api_key_env="K", api_key_file=str(key_file)
    )


def test_files_a_profile_names_are_read_within_a_bound(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k-" + "x" * (64 * 1024))  # no key is this long: a wrong file, never read whole
    with pytest.raises(ConfigError, match=r"api_key_file: .* is larger than") as caught:
        profile(api_key_file=str(key_file)).api_key()
    assert "xxxx" not in str(caught.value)
    warm = tmp_path / "prefix.txt"
    warm.write_bytes(b"a" * (4 * 2**20 + 1))
    assert "warm-up file: " in error_of(warmup=[{"file": str(warm)}])
    assert "is larger than" in error_of(warmup=[{"file": str(warm)}])


@pytest.mark.parametrize(
    ("arg", "field"),
    [
        ("--port", "port"),
        ("--port=9000", "port"),
        ("--kv-cache-dtype", "kv_cache_dtype"),
        ("--kv_cache_dtype=fp8", "kv_cache_dtype"),
        ("--no-enable-prefix-caching", "enable_prefix_caching"),
        ("--api-key", "api_key_env"),
    ],
)
def test_extra_args_cannot_repeat_a_managed_flag(arg: str, field: str) -> None:
    message = error_of(extra_args=["--disable-log-stats", arg, "1"])
    assert f"extra_args[1]: {arg.split('=')[0]!r} is vLLM's --" in message
    assert f"the profile field {field!r}" in message


def test_every_rendered_flag_is_managed() -> None:
    """A flag added to vllm_options but not to MANAGED_FLAGS could be repeated in extra_args unnoticed."""
    everything = profile(
        served_model_name="s", num_gpu_blocks_override=100, max_num_seqs=4, max_num_batched_tokens=2048,
        enable_chunked_prefill=True, enforce_eager=True, dtype="float32",
    )  # fmt: skip
    assert set(everything.vllm_options("/m")) <= set(MANAGED_FLAGS)
    for flag, field in MANAGED_FLAGS.items():
        assert field in EngineProfile.model_fields, (flag, field)


def test_rendered_command_and_script_quote_every_word(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    hostile = profile(env={"KVTUNE_NOTE": CHAINED.format(marker=marker)}, served_model_name="it's; rm -rf /")
    command = hostile.launch_command("/models/a b")
    assert shlex.split(shlex.join(command)) == command
    assert command[0] == "env" and command[1] == "VLLM_TARGET_DEVICE=cpu"
    assert f"KVTUNE_NOTE={CHAINED.format(marker=marker)}" in command
    script = tmp_path / "serve.sh"
    script.write_text(hostile.serve_script("/models/a b", ["line one\nline two"]))
    # `sh -n` parses without running; then a run with `exec` swapped for `echo` shows the words it passes.
    assert subprocess.run(["sh", "-n", str(script)], check=False).returncode == 0
    echoed = script.read_text().replace("exec env ", "exec printf '%s\\n' env ")
    result = subprocess.run(["sh", "-c", echoed], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == command
    assert not marker.exists(), "a profile value ran as a command"


def test_script_refuses_to_start_without_its_credentials(tmp_path: Path) -> None:
    script = tmp_path / "serve.sh"
    script.write_text(
        profile(secret_env=["KVTUNE_TEST_SECRET"], api_key_env="KVTUNE_TEST_KEY").serve_script()
    )
    env = {"PATH": "/usr/bin:/bin"}
    result = subprocess.run(["sh", str(script)], capture_output=True, text=True, env=env, check=False)
    assert result.returncode != 0
    assert "set KVTUNE_TEST_SECRET in the environment" in result.stderr
    result = subprocess.run(
        ["sh", str(script)],
        capture_output=True,
        text=True,
        env=env | {"KVTUNE_TEST_SECRET": "s"},
        check=False,
    )
    assert "set KVTUNE_TEST_KEY to the API key" in result.stderr
