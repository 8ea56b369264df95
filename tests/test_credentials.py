"""Which names and values are credentials: common secret naming caught, vLLM's own settings left alone,
and a credential typed where its variable's name belongs refused without being quoted back."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import vllm.envs
import yaml

from kvtune.config_errors import ConfigError
from kvtune.credentials import looks_secret, posix_name_problem, value_looks_secret
from kvtune.profile import load_profile
from tests.helpers import default_profile_data

SECRET_NAMES = [
    "HF_TOKEN",
    "HFTOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "VLLM_API_KEY",
    "APIKEY",
    "AWS_SECRET_ACCESS_KEY",
    "DB_PASS",
    "PGPASSWORD",
    "DB_PASSWORD",
    "GITHUB_PAT",
    "CLIENT_SECRET",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "ssh_passphrase",
]
SECRET_VALUES = [
    "postgres://app:hunter2@db:5432/x",
    "https://user:pa%40ss@host/",
    "hf_" + "a1B2" * 8,
    "sk-live-" + "x" * 24,
    "ghp_" + "A" * 36,
    "github_pat_" + "1" * 30,
    "glpat-" + "z" * 20,
    "AKIA" + "ABCDEFGHIJKLMNOP",
    "Bearer abcdefghijkl",
]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_common_secret_names_are_credentials(name: str) -> None:
    assert looks_secret(name)


def test_no_variable_vllm_reads_is_taken_for_a_credential_but_its_keys() -> None:
    names = [name for name in vllm.envs.environment_variables if re.fullmatch(r"[A-Z0-9_]+", name)]
    assert len(names) > 100  # the list really was read
    assert [name for name in names if looks_secret(name)] == ["VLLM_API_KEY", "S3_SECRET_ACCESS_KEY"]
    for name in ("HF_HOME", "HF_TOKEN_PATH", "KEYBOARD", "OMP_NUM_THREADS", "DATABASE_URL", "PASSES"):
        assert not looks_secret(name), name


@pytest.mark.parametrize("value", SECRET_VALUES)
def test_credentials_are_known_by_their_form(value: str) -> None:
    assert value_looks_secret(value)
    problem = posix_name_problem(value)
    assert problem is not None and "looks like a credential itself" in problem
    assert value not in problem and value[:8] not in problem


@pytest.mark.parametrize("value", ["http://127.0.0.1:8000", "https://user@host/", "/models/x", "fp8", "128"])
def test_ordinary_values_are_not_credentials(value: str) -> None:
    assert not value_looks_secret(value)


def test_a_long_or_spaced_non_name_is_not_quoted_back() -> None:
    for typed in ("a password with spaces", "x" * 41 + "-"):
        problem = posix_name_problem(typed)
        assert problem is not None and typed not in problem and "the value given" in problem


def test_a_profile_refuses_a_credential_by_its_value_and_never_quotes_it(tmp_path: Path) -> None:
    url = "postgres://app:hunter2@db:5432/x"
    key = "sk-live-" + "q" * 24
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"env": {"DATABASE_URL": url}}, "env.DATABASE_URL: looks like a credential", "hunter2"),
        ({"api_key_env": key}, "api_key_env: looks like a credential itself", key),
        ({"secret_env": [key]}, "secret_env[0]: looks like a credential itself", key),
    ]
    for fields, expected, secret in cases:
        path = tmp_path / "profile.yaml"
        path.write_text(yaml.safe_dump(default_profile_data(**fields)))
        with pytest.raises(ConfigError) as caught:
            load_profile(path)
        assert expected in str(caught.value)
        assert secret not in str(caught.value)
