"""`kvtune up` plans every port of a run at once: a port with two users, or out of range, is refused before
anything starts, naming both users; ports in use are refused naming their user; router workers' ports are
drawn clear of every planned one; and the router's numeric flags take ranges, stated in the refusal.

The plan is exercised with generated runs (engines with KV events and replay, a router and its workers,
the control API, Prometheus) against an independent count of each port's users; the command line with
collisions as a user writes them, in a subprocess that must refuse within seconds, and in-process with
every start replaced by a failure so nothing can start.
"""

from __future__ import annotations

import argparse
import itertools
import re
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.cli import build_parser
from kvtune.cli import main as cli_main
from kvtune.commands import up
from kvtune.config_errors import ConfigError
from kvtune.engine import free_port
from kvtune.port_plan import PortUse, bound, check_plan, draw_ports, engine_ports, plan_problem
from kvtune.profile import EngineProfile
from kvtune.router.server import RouterOptions
from tests.helpers import default_profile_data

COLLISION = re.compile(r"port (-?\d+) is both (.+?) and (.+): give each its own port$")
OUT_OF_RANGE = re.compile(r"port (-?\d+) of (.+) is not a port number: give 1-65535$")


# ---- the plan alone ---------------------------------------------------------------------------------------

# Few distinct numbers, so collisions are common; a few out of range.
PORTS = st.one_of(st.integers(20_000, 20_006), st.sampled_from([-1, 0, 65_536, 70_000]))


@settings(max_examples=300, deadline=None)
@given(st.lists(PORTS, max_size=8))
def test_the_plan_refuses_exactly_a_shared_or_out_of_range_port_naming_its_users(ports: list[int]) -> None:
    uses = [PortUse(port, f"user {i}", f"--flag-{i}") for i, port in enumerate(ports)]
    problem = plan_problem(uses)
    users: dict[int, list[str]] = defaultdict(list)
    for use in uses:
        users[use.port].append(str(use))
    out_of_range = [p for p in ports if not 1 <= p <= 65535]
    shared = {port for port, names in users.items() if len(names) > 1}
    if not out_of_range and not shared:
        assert problem is None
        check_plan(uses)
        return
    assert problem is not None
    with pytest.raises(ConfigError, match=re.escape(problem)):
        check_plan(uses)
    assert "\n" not in problem
    if out_of_range:
        found = OUT_OF_RANGE.match(problem)
        assert found, problem
        assert int(found[1]) in out_of_range and found[2] in users[int(found[1])]
    else:
        found = COLLISION.match(problem)
        assert found, problem
        port, first, second = int(found[1]), found[2], found[3]
        assert port in shared and first != second
        assert {first, second} <= set(users[port])


# ---- the plan of a whole run, as `kvtune up` builds it ----------------------------------------------------

SMALL = st.integers(20_000, 20_012)


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    engines = []
    for index in range(draw(st.integers(1, 4))):
        events = draw(st.none() | SMALL)
        replay = draw(st.none() | SMALL) if events is not None else None
        engines.append({"name": f"e{index}", "port": draw(SMALL), "events": events, "replay": replay})
    return {
        "engines": engines,
        "router": draw(st.none() | SMALL),
        "workers": draw(st.integers(1, 3)),
        "control": draw(SMALL),
        "prometheus": draw(st.none() | SMALL),
    }


def plan_of(run: dict[str, Any]) -> tuple[list[PortUse], RouterOptions | None]:
    engines = [
        (
            EngineProfile(
                name=e["name"], device="cpu", model="fake-model", port=e["port"],
                kv_events_port=e["events"], kv_events_replay_port=e["replay"],
            ),
            f"{e['name']}.yaml",
            0,
        )
        for e in run["engines"]
    ]  # fmt: skip
    router = None
    if run["router"] is not None:
        router = RouterOptions("round_robin", port=run["router"], workers=run["workers"])
    args = argparse.Namespace(
        control_host="127.0.0.1",
        control_port=run["control"],
        prometheus=run["prometheus"] is not None,
        prometheus_port=run["prometheus"] or 9090,
    )
    return up.plan_ports(args, engines, router)


def users_by_port(run: dict[str, Any]) -> dict[int, list[str]]:
    """Who uses each port, written out from the run itself (not by the plan)."""
    users: dict[int, list[str]] = defaultdict(list)
    for e in run["engines"]:
        name, origin = e["name"], f"profile {e['name']}.yaml"
        users[e["port"]].append(f"engine '{name}' ({origin}: port)")
        if e["events"] is not None:
            users[e["events"]].append(f"the KV events of engine '{name}' ({origin}: kv_events_port)")
        if e["replay"] is not None:
            users[e["replay"]].append(
                f"the KV-event replay of engine '{name}' ({origin}: kv_events_replay_port)"
            )
    if run["router"] is not None:
        users[run["router"]].append("the router (--router-port)")
    users[run["control"]].append("the control API (--control-port)")
    if run["prometheus"] is not None:
        users[run["prometheus"]].append("Prometheus (--prometheus-port)")
    return users


@settings(max_examples=200, deadline=None)
@given(runs())
def test_a_run_is_refused_exactly_when_two_of_its_users_share_a_port(run: dict[str, Any]) -> None:
    users = users_by_port(run)
    shared = {port for port, names in users.items() if len(names) > 1}
    if not shared:
        uses, router = plan_of(run)
        ports = [use.port for use in uses]
        assert len(ports) == len(set(ports)), "every planned port has one user, drawn ones included"
        if router is not None and router.workers > 1:
            assert len(router.worker_ports) == router.workers
            assert set(router.worker_ports) <= set(ports), "the workers get the ports the plan drew"
            assert not set(router.worker_ports) & set(users), "drawn clear of every fixed port"
        return
    with pytest.raises(ConfigError) as refused:
        plan_of(run)
    found = COLLISION.match(str(refused.value))
    assert found, refused.value
    port, first, second = int(found[1]), found[2], found[3]
    assert port in shared and first != second and {first, second} <= set(users[port]), refused.value


def test_a_replica_names_the_field_its_port_comes_from() -> None:
    profile = EngineProfile(
        name="p-1", device="cpu", model="m", port=8001, kv_events_port=5558, kv_events_replay_port=5601
    )
    assert [str(use) for use in engine_ports(profile, "p.yaml", replica=1)] == [
        "engine 'p-1' (profile p.yaml: port + 1)",
        "the KV events of engine 'p-1' (profile p.yaml: kv_events_port + 1)",
        "the KV-event replay of engine 'p-1' (profile p.yaml: kv_events_replay_port + 1)",
    ]


def test_only_ports_the_run_binds_are_probed() -> None:
    profile = EngineProfile(name="a", device="cpu", model="m", port=8000, kv_events_port=5557)
    alone = [use.port for _host, use in bound(engine_ports(profile, "a.yaml"))]
    assert alone == [8000], "with no router, vLLM connects to its KV-event port: someone may listen there"
    routed = [use.port for _host, use in bound(engine_ports(profile, "a.yaml", events_bound=True))]
    assert routed == [8000, 5557]


@given(st.lists(st.integers(30_000, 30_005), min_size=1, max_size=40), st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_drawn_ports_are_distinct_and_clear_of_the_plan_or_refused(offers: list[int], wanted: int) -> None:
    fixed = [
        PortUse(30_000, "engine 'a'", "profile a.yaml: port"),
        PortUse(30_001, "the router", "--router-port"),
    ]
    offered = itertools.cycle(offers)
    users = [f"router worker {i}" for i in range(wanted)]
    free = set(offers) - {30_000, 30_001}
    if len(free) < wanted:  # the OS keeps offering taken ports: refused, not an endless loop
        with pytest.raises(ConfigError, match="the OS offered only ports already planned"):
            draw_ports(fixed, users, "127.0.0.1", lambda: next(offered))
        return
    drawn = draw_ports(fixed, users, "127.0.0.1", lambda: next(offered))
    ports = [use.port for use in drawn]
    assert len(set(ports)) == wanted and set(ports) <= free
    assert [use.user for use in drawn] == users and all(use.bind_host == "127.0.0.1" for use in drawn)


# ---- `kvtune up` refuses in planning: nothing starts ----------------------------------------------------


def write_fleet(folder: Path, *engines: dict[str, Any]) -> list[str]:
    paths = []
    for fields in engines:
        path = folder / f"{fields['name']}.yaml"
        path.write_text(yaml.safe_dump(default_profile_data(**fields)))
        paths.append(str(path))
    return paths


def collision_cases(folder: Path) -> Iterator[tuple[list[str], str]]:
    """(argv after `up`, the refusal) for each kind of collision, on ports nothing listens on."""
    a, b, c, d = (free_port() for _ in range(4))
    two = write_fleet(folder, {"name": "a", "port": a}, {"name": "b", "port": b})
    engine_a, engine_b = (f"engine '{n}' (profile {path}: port)" for n, path in zip("ab", two, strict=True))

    def both(port: int, first: str, second: str) -> str:
        return f"port {port} is both {first} and {second}"

    yield [*two, "--router-port", str(a)], both(a, engine_a, "the router (--router-port)")
    yield [*two, "--control-port", str(b)], both(b, engine_b, "the control API (--control-port)")
    yield (
        [*two, "--prometheus", "--prometheus-port", str(a)],
        both(a, engine_a, "Prometheus (--prometheus-port)"),
    )
    (same,) = write_fleet(folder, {"name": "s", "port": c, "kv_events_port": d, "kv_events_replay_port": d})
    events = f"the KV events of engine 's' (profile {same}: kv_events_port)"
    replay = f"the KV-event replay of engine 's' (profile {same}: kv_events_replay_port)"
    yield [same], both(d, events, replay)
    (own,) = write_fleet(folder, {"name": "o", "port": c, "kv_events_port": d, "kv_events_replay_port": c})
    replay = f"the KV-event replay of engine 'o' (profile {own}: kv_events_replay_port)"
    yield [own], both(c, f"engine 'o' (profile {own}: port)", replay)
    (twin,) = write_fleet(folder, {"name": "t", "port": a})
    yield [two[0], twin], both(a, engine_a, f"engine 't' (profile {twin}: port)")
    (cross,) = write_fleet(folder, {"name": "x", "port": c, "kv_events_port": a})
    events = f"the KV events of engine 'x' (profile {cross}: kv_events_port)"
    yield [two[0], cross, "--router", "prefix"], both(a, engine_a, events)


# The real command line, with the steps after planning (preparing the model, making an engine) ending the
# process: a collision the plan misses then exits 97 instead of starting vLLM.
GUARDED_CLI = """
import os, sys
from kvtune.commands import up
def started(*args, **kwargs):
    print("planning let the run start", file=sys.stderr, flush=True)
    os._exit(97)
up.resolve_model = up.Engine = started
from kvtune.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_up_refuses_each_collision_in_seconds_with_both_users_named(tmp_path: Path) -> None:
    for argv, expected in collision_cases(tmp_path):
        logs = tmp_path / "logs"
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", GUARDED_CLI, "up", *argv, "--log-dir", str(logs)],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        seconds = time.monotonic() - started
        output = done.stdout + done.stderr
        flat = " ".join(output.split())
        assert done.returncode == 2, output
        assert f"error: {expected}: give each its own port" in flat, flat
        assert "Traceback" not in output
        assert seconds < 20, f"{argv}: refused after {seconds:.0f} s"
        assert not logs.exists(), "refused in planning: no log folder, no engine log"


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every start of `kvtune up` fails the test: a refusal must come from planning."""

    def started(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("something started")

    for name in (
        "Engine",
        "Supervisor",
        "ControlServer",
        "PrometheusServer",
        "fleet_router",
        "RouterWorkers",
    ):
        monkeypatch.setattr(up, name, started)
    monkeypatch.setattr(up, "resolve_model", started)


def test_up_refuses_collisions_before_any_engine_is_made(
    tmp_path: Path, nothing_starts: None, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, expected in collision_cases(tmp_path):
        assert cli_main(["up", *argv, "--log-dir", str(tmp_path / "logs")]) == 2
        assert expected in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("user", ["engine", "events", "replay", "router", "control", "prometheus"])
def test_up_refuses_a_planned_port_in_use_naming_its_user(
    tmp_path: Path, nothing_starts: None, capsys: pytest.CaptureFixture[str], user: str
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        port, events, replay, router, control, prometheus = (
            busy if user == name else free_port()
            for name in ("engine", "events", "replay", "router", "control", "prometheus")
        )
        paths = write_fleet(
            tmp_path,
            {"name": "a", "port": port, "kv_events_port": events, "kv_events_replay_port": replay},
            {"name": "b", "port": free_port(), "kv_events_port": free_port()},
        )
        argv = ["up", *paths, "--log-dir", str(tmp_path / "logs"), "--router-port", str(router)]
        argv += ["--control-port", str(control), "--prometheus", "--prometheus-port", str(prometheus)]
        assert cli_main(argv) == 2
    named = {
        "engine": f"engine 'a' (profile {paths[0]}: port)",
        "events": f"the KV events of engine 'a' (profile {paths[0]}: kv_events_port)",
        "replay": f"the KV-event replay of engine 'a' (profile {paths[0]}: kv_events_replay_port)",
        "router": "the router (--router-port)",
        "control": "the control API (--control-port)",
        "prometheus": "Prometheus (--prometheus-port)",
    }[user]
    err = " ".join(capsys.readouterr().err.split())
    assert f"{named}: port {busy} on 127.0.0.1 is already in use" in err, err
    assert not (tmp_path / "logs").exists()


def test_router_workers_get_ports_from_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ports the workers and Prometheus are given are the plan's, distinct and clear of the fixed ones,
    even when the OS offers an engine's port or the same port twice."""
    engine_port, router_port = free_port(), free_port()
    offers = iter([engine_port, router_port, engine_port, *(free_port() for _ in range(8))])
    monkeypatch.setattr(up, "free_port", lambda: next(offers))
    engines = [
        (EngineProfile(name=name, device="cpu", model="m", port=port), f"{name}.yaml", 0)
        for name, port in (("a", engine_port), ("b", free_port()))
    ]
    argv = ["up", "a.yaml", "b.yaml", "--control-port", str(free_port())]
    router = RouterOptions("round_robin", port=router_port, workers=4)
    uses, planned = up.plan_ports(build_parser(argv).parse_args(argv), engines, router)
    assert planned is not None and len(set(planned.worker_ports)) == 4
    assert not {engine_port, router_port} & set(planned.worker_ports)
    assert [str(use) for use in uses[-4:]] == [f"router worker {i} (drawn by kvtune)" for i in range(4)]
    targets = up.router_scrape_targets(planned)
    assert [t.port for t in targets] == list(planned.worker_ports), "Prometheus scrapes the planned ports"


# ---- the router's numeric flags take ranges ------------------------------------------------------------

FLAG_RANGES = {
    "--router-workers": (1, 64, True),
    "--router-max-body-mib": (0.001, 4096, False),
    "--router-load-factor": (1, 100, False),
    "--capture-max-mib": (0.01, 16384, False),
    "--capture-keep": (1, 10_000, True),
}


def parse_up(tmp_path: Path, flag: str, value: str) -> argparse.Namespace:
    argv = ["up", str(tmp_path / "p.yaml"), flag, value]
    return build_parser(argv).parse_args(argv)


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(sorted(FLAG_RANGES)),
    st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.integers(-(10**6), 10**6),
        st.sampled_from([0.0, 1e-9, 0.000001, 1.0, 64, 65, 100000, 4096.5, 16385]),
    ),
)
def test_router_flags_take_a_range_and_refuse_outside_it(flag: str, value: float) -> None:
    least, most, whole = FLAG_RANGES[flag]
    text = str(value)
    in_range = (value > least if flag == "--router-load-factor" else value >= least) and value <= most
    if whole:
        in_range = in_range and isinstance(value, int)
    if in_range:
        args = parse_up(Path("/nowhere"), flag, text)
        assert getattr(args, flag.removeprefix("--").replace("-", "_")) == value
        return
    with pytest.raises(SystemExit) as exited:
        parse_up(Path("/nowhere"), flag, text)
    assert exited.value.code == 2


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--router-workers", "100000", "--router-workers: 100000 is out of range; give 1 to 64"),
        ("--router-workers", "0", "--router-workers: 0 is out of range; give 1 to 64"),
        ("--router-max-body-mib", "1e-9", "--router-max-body-mib: 1e-9 is out of range; give 0.001 to 4,096"),
        ("--router-max-body-mib", "0.000001", "--router-max-body-mib: 0.000001 is out of range"),
        ("--router-max-body-mib", "nan", "--router-max-body-mib: nan is out of range"),
        ("--router-load-factor", "1", "--router-load-factor: 1 is out of range; give one above 1 and at"),
        ("--capture-max-mib", "1e-9", "--capture-max-mib: 1e-9 is out of range; give 0.01 to 16,384 MiB"),
        ("--capture-keep", "1e9", "--capture-keep: '1e9' is not a whole number"),
    ],
)  # fmt: skip
def test_router_flag_refusals_state_the_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, expected: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_up(tmp_path, flag, value)
    assert exited.value.code == 2
    assert expected in " ".join(capsys.readouterr().err.split())


def test_the_router_flags_help_states_their_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["up", "--help"]).parse_args(["up", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for said in (
        "1 to 64",
        "0.001 to 4096 MiB",
        "above 1 and at most 100",
        "0.01 to 16384 MiB",
        "1 to 10,000",
    ):
        assert said in shown, said


@pytest.mark.parametrize(("flag", "expected"), [([], None), (["--router-max-body-mib", "0.001"], 1049)])
def test_the_body_limit_reaches_the_router_as_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: list[str], expected: int | None
) -> None:
    """The least the flag takes is 1,049 bytes, passed on as such; no flag leaves the limit to the model."""
    given: list[int | None] = []

    def options_for(*_args: Any, max_body_bytes: int | None = None, **_kwargs: Any) -> None:
        given.append(max_body_bytes)
        raise ConfigError("stop here")

    monkeypatch.setattr(up, "router_options_for", options_for)
    paths = write_fleet(tmp_path, {"name": "a", "port": free_port()}, {"name": "b", "port": free_port()})
    argv = ["up", *paths, *flag]
    with pytest.raises(ConfigError, match="stop here"):
        up.main(build_parser(argv).parse_args(argv))
    assert given == [expected]
