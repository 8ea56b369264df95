"""Shared fixtures: the prepared embedded model, free ports, profiles derived from the shipped default."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune.engine import Engine
from kvtune.model_store import ensure_model
from kvtune.profile import EngineProfile

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
ARTIFACTS = REPO / "test-artifacts"

ProfileFactory = Callable[..., EngineProfile]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def default_profile_data(**overrides: Any) -> dict[str, Any]:
    """The shipped CPU profile as a dict, on a free port, with overrides."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["port"] = free_port()
    data.update(overrides)
    return data


@pytest.fixture(scope="session")
def model_path() -> str:
    """The embedded model, prepared once in the user's cache (where `make setup` put it)."""
    return str(ensure_model("smollm2-135m"))


@pytest.fixture(scope="session")
def make_profile() -> ProfileFactory:
    def make(**overrides: Any) -> EngineProfile:
        profile, _note = EngineProfile.model_validate(default_profile_data(**overrides)).adapted_to_host()
        return profile

    return make


@pytest.fixture(scope="session")
def default_engine(model_path: str, make_profile: ProfileFactory) -> Iterator[Engine]:
    """One engine of the shipped default profile, shared by the tests that only send requests."""
    ARTIFACTS.mkdir(exist_ok=True)
    profile = make_profile(name="default-engine")
    with Engine(profile, ARTIFACTS / "default-engine.log", model_path=model_path) as engine:
        yield engine


# 16-bit weights and KV: the fp8 test's same-budget baseline and, where fp8 KV cannot run, the quality
# gate's benign precision change. One engine for both (bf16 starts slowly on CPUs without AVX-512 BF16).
SIXTEEN_BIT = {"dtype": "bfloat16", "kv_cache_dtype": "auto", "kv_cache_dtype_fallback": None}


@pytest.fixture(scope="session")
def bf16_engine(model_path: str, make_profile: ProfileFactory) -> Iterator[Engine]:
    ARTIFACTS.mkdir(exist_ok=True)
    profile = make_profile(name="bf16-engine", **SIXTEEN_BIT)
    with Engine(profile, ARTIFACTS / "bf16-engine.log", model_path=model_path) as engine:
        yield engine


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300.0) as client:
        yield client
