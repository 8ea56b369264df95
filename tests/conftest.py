"""Shared fixtures: the prepared embedded model, free ports, profiles derived from the shipped default."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune.engine import Engine, free_port
from kvtune.model_store import ensure_model
from kvtune.processes import stop_group
from kvtune.profile import EngineProfile

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
ARTIFACTS = REPO / "test-artifacts"

ProfileFactory = Callable[..., EngineProfile]

# Engines compute on both cores and session fixtures share them, so every test that starts or uses an
# engine runs on one pytest-xdist worker, in file order (`make test`: `-n 2 --dist loadgroup`); the fast
# tests run beside them on the other worker. A test that uses an engine fixture is marked `engine` too, so
# `pytest -m engine` (`make test-slow-host`) selects every one of them.
ENGINE_FIXTURES = frozenset({"model_path", "default_engine", "bf16_engine", "keyed_up"})


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns xdist_group marks into groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("engine") or fixtures & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.xdist_group("engines"))


def default_profile_data(**overrides: Any) -> dict[str, Any]:
    """The shipped CPU profile as a dict, on a free port, with overrides."""
    data: dict[str, Any] = yaml.safe_load(DEFAULT_PROFILE.read_text())
    data["port"] = free_port()
    # Test engines start eager (~40 s, not ~2 min compiled): what they assert does not depend on speed.
    data["enforce_eager"] = True
    data.update(overrides)
    return data


def write_test_profile(path: Path, **overrides: Any) -> Path:
    """The shipped CPU profile as tests run it (eager, a free port), written to `path`."""
    path.write_text(yaml.safe_dump(default_profile_data(**overrides)))
    return path


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


# Made-up credentials of the keyed engine: an API key clients must send and a secret the engine gets.
KEYED_API_KEY = "kvtune-test-key-5b1f0c"
KEYED_SECRET = "kvtune-test-secret-9d2e7a"
KEYED_CREDENTIALS = {"KVTUNE_TEST_API_KEY": KEYED_API_KEY, "KVTUNE_TEST_SECRET": KEYED_SECRET}
KEYED_SYSTEM_PROMPT = "You answer in one short sentence about European capitals. " * 40  # > 2 KV blocks


def keyed_profile_data(**overrides: Any) -> dict[str, Any]:
    """The shipped profile with an API key, a secret and a warm-up prefix (credentials by name only)."""
    settings: dict[str, Any] = {
        "name": "keyed",
        "api_key_env": "KVTUNE_TEST_API_KEY",
        "secret_env": ["KVTUNE_TEST_SECRET"],
        "max_model_len": 2048,
        "kv_cache_memory_bytes": "256MiB",
        "warmup": [{"role": "system", "text": KEYED_SYSTEM_PROMPT}],
    }
    return default_profile_data(**(settings | overrides))


@dataclass(frozen=True)
class KeyedEngine:
    """An engine `kvtune up` runs with credentials: refuses /v1 requests without the key."""

    profile: EngineProfile
    control_url: str
    folder: Path  # the profile and the engine logs: kvtune's own files for this engine

    @property
    def url(self) -> str:
        return self.profile.url


@contextlib.contextmanager
def running_up(
    up_args: list[str],
    log_name: str,
    engines: int = 1,
    env: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> Iterator[subprocess.Popen[bytes]]:
    """`kvtune up UP_ARGS...` as a user runs it (its output in test-artifacts/LOG_NAME), until ENGINES
    engines are ready by its control API (UP_ARGS name --control-port); stopped by SIGTERM, its own stop
    path, then its process group."""
    control_port = up_args[up_args.index("--control-port") + 1]
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / log_name
    argv = [sys.executable, "-m", "kvtune.cli", "up", *up_args]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env=os.environ | (env or {}), start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s
        while not engines_ready(f"http://127.0.0.1:{control_port}", engines):
            assert proc.poll() is None, f"kvtune up exited early: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"engines not ready: {log.read_text()[-3000:]}"
            time.sleep(1.0)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)  # kvtune up's own stop: drains and stops the engines' groups
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
        stop_group(proc, grace_s=5)


@pytest.fixture(scope="session")
def keyed_up(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[KeyedEngine]:
    """`kvtune up` of a keyed profile, as a user starts it, shared by the credential and load tests."""
    folder = tmp_path_factory.mktemp("keyed-up")
    profile_path = folder / "keyed.yaml"
    profile_path.write_text(yaml.safe_dump(keyed_profile_data()))
    control_url = f"http://127.0.0.1:{free_port()}"
    args = [
        str(profile_path),
        "--log-dir",
        str(folder / "logs"),
        "--control-port",
        control_url.rsplit(":", 1)[1],
    ]
    with running_up(args, "keyed-up.log", env=KEYED_CREDENTIALS):
        profile = EngineProfile.model_validate(yaml.safe_load(profile_path.read_text()))
        yield KeyedEngine(profile, control_url, folder)


def engines_ready(control_url: str, count: int = 1) -> bool:
    """COUNT engines `kvtune up` runs are all ready, by its control API's /health (which takes no key)."""
    try:
        health = httpx.get(f"{control_url}/health", timeout=5).json()
    except httpx.HTTPError:
        return False
    return bool(health["ok"]) and health["engines"] >= count


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300.0) as client:
        yield client
