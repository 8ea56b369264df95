"""Shared fixtures and hooks: the prepared embedded model, the session's engines, a made-up CPU host, the
grouping of engine tests, and the count of engine starts printed at the session's end. What tests import
lives in tests/helpers*.py."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune.engine import Engine, free_port
from kvtune.model_store import ensure_model
from kvtune.profile import EngineProfile
from tests import helpers_ledger
from tests.helpers import (
    ARTIFACTS,
    KEYED_CREDENTIALS,
    SIXTEEN_BIT,
    FakeHost,
    ProfileFactory,
    default_profile_data,
    keyed_profile_data,
)
from tests.helpers_up import KeyedEngine, running_up

# Engines compute on both cores and session fixtures share them, so every test that starts or uses an
# engine runs on one pytest-xdist worker, in file order (`make test`: `-n 2 --dist loadgroup`); the fast
# tests run beside them on the other worker. A test that uses an engine fixture is marked `engine` too, so
# `pytest -m engine` (`make test-slow-host`) selects every one of them.
ENGINE_FIXTURES = frozenset({"model_path", "default_engine", "bf16_engine", "keyed_up"})

_SESSION_STARTED = pytest.StashKey[float]()
_LEDGER = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fake_host(cpu='avx512', cores=None, device=None): the host the fake_host fixture shows"
    )
    config.addinivalue_line(
        "markers",
        "quiet_host: compares rates measured minutes apart in one test, so it runs after every other test "
        "(by then the fast tests on the other worker are done, and the host is the same throughout)",
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook turns xdist_group marks into groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("engine") or fixtures & ENGINE_FIXTURES:
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.xdist_group("engines"))
    # A stable sort: quiet_host tests last, the rest in their order.
    items.sort(key=lambda item: item.get_closest_marker("quiet_host") is not None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist starts its workers: they inherit the environment
def pytest_sessionstart(session: pytest.Session) -> None:
    """Every vLLM server this session starts, however deep below it, appends a line to one ledger."""
    config = session.config
    config.stash[_SESSION_STARTED] = time.monotonic()
    # pytest-xdist finds its workers' basetemp the same way (pytest has no public handle this early).
    basetemp = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    config.stash[_LEDGER] = helpers_ledger.enable(basetemp / "engine-starts.jsonl")
    # The engines share two cores with the fast tests on the other worker. vLLM pins one OpenMP thread to
    # each core, and OpenMP's default spins at each barrier while the other thread is descheduled: on a
    # host loaded ~4x, 32-token answers took 8-41 s spinning and 4-8 s with sleeping waits (same engine,
    # alternating runs). A user's profile leaves the policy to them; the tests choose the shared host's.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or _LEDGER not in config.stash or config.option.collectonly:
        return  # a pytest-xdist worker (its controller reports the whole session), or nothing was run
    starts = helpers_ledger.read_ledger(config.stash[_LEDGER])
    wall_s = time.monotonic() - config.stash[_SESSION_STARTED]
    terminalreporter.write_sep("-", "engine starts")
    for line in helpers_ledger.summary_lines(starts, wall_s):
        terminalreporter.write_line(line)


@pytest.fixture
def fake_host(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> FakeHost:
    """kvtune.platform reports a made-up CPU host: AVX-512 unless a `fake_host(cpu=..., cores=...,
    device=...)` mark on the test, class or module (the nearest wins), or indirect parametrisation, says
    otherwise. A module makes it its default with `pytest.mark.usefixtures("fake_host")`; a test changes
    it with `fake_host.use(...)`."""
    settings: dict[str, Any] = {}
    for marker in reversed(list(request.node.iter_markers("fake_host"))):
        settings |= marker.kwargs
    settings |= getattr(request, "param", {})
    host = FakeHost(monkeypatch)
    host.use(**settings)
    return host


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


@pytest.fixture(scope="session")
def bf16_engine(model_path: str, make_profile: ProfileFactory) -> Iterator[Engine]:
    """16-bit weights and KV (SIXTEEN_BIT), shared by the fp8 and quality-gate tests."""
    ARTIFACTS.mkdir(exist_ok=True)
    profile = make_profile(name="bf16-engine", **SIXTEEN_BIT)
    with Engine(profile, ARTIFACTS / "bf16-engine.log", model_path=model_path) as engine:
        yield engine


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


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=300.0) as client:
        yield client
