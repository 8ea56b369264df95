"""Every port one `kvtune up` uses, planned together before anything starts.

A run uses many ports: each engine's HTTP port, the port its KV events go to (the router binds it) and the
one its replay is served on, the router's port and each router worker's own, the control API's and
Prometheus's. Checked one at a time, a port with two users was found only when the second failed to bind,
after the engines had started (about a minute each on a 2-core host). A plan lists each port with its user
and where its number was set, so a clash is refused at once naming both users, and the ports kvtune draws
for its router workers avoid every port already planned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvtune.config_errors import ConfigError
from kvtune.profile import EngineProfile

LOWEST_PORT = 1
HIGHEST_PORT = 65535
# Tries per drawn port: the OS hands out a free port per ask and may hand the same one again (its ephemeral
# range is ~28,000 ports), so a draw repeats until each port is new; a host that keeps giving taken ones
# is out of ports, not unlucky.
DRAW_TRIES_PER_PORT = 100


@dataclass(frozen=True)
class PortUse:
    """One port of the run: who uses it, where its number came from, and where the run binds it."""

    port: int
    user: str  # "engine 'a'", "the router"
    source: str  # where the number was set: "profile a.yaml: port", "--router-port", "drawn by kvtune"
    # The address this run binds it on, probed before the start; None when nothing of the run binds it
    # (an engine's KV events with no router: vLLM connects there and someone else may listen on purpose).
    bind_host: str | None = None

    def __str__(self) -> str:
        return f"{self.user} ({self.source})"


def plan_problem(uses: Sequence[PortUse]) -> str | None:
    """Why USES cannot all run (a port out of 1-65535, or one port with two users), in one line naming the
    users; None when they can."""
    for use in uses:
        if not LOWEST_PORT <= use.port <= HIGHEST_PORT:
            return f"port {use.port} of {use} is not a port number: give {LOWEST_PORT}-{HIGHEST_PORT}"
    first_user: dict[int, PortUse] = {}
    for use in uses:
        if use.port in first_user:
            return f"port {use.port} is both {first_user[use.port]} and {use}: give each its own port"
        first_user[use.port] = use
    return None


def check_plan(uses: Sequence[PortUse]) -> None:
    """ConfigError (exit 2) when USES cannot all run."""
    problem = plan_problem(uses)
    if problem is not None:
        raise ConfigError(problem)


def draw_ports(
    uses: Sequence[PortUse], users: Sequence[str], bind_host: str, pick: Callable[[], int]
) -> list[PortUse]:
    """A port for each of USERS, bound on BIND_HOST, asked of PICK (the OS: a port free now): distinct, and
    none of USES' ports. ConfigError when PICK keeps offering ports already planned."""
    taken = {use.port for use in uses}
    drawn: list[PortUse] = []
    tries = DRAW_TRIES_PER_PORT * len(users)
    for user in users:
        port = pick()
        tries -= 1
        while port in taken or not LOWEST_PORT <= port <= HIGHEST_PORT:
            if tries <= 0:
                raise ConfigError(
                    f"{user}: the OS offered only ports already planned ({len(drawn)} of {len(users)} "
                    "drawn); free some ports on this host, or start fewer router workers"
                )
            port = pick()
            tries -= 1
        taken.add(port)
        drawn.append(PortUse(port, user, "drawn by kvtune", bind_host))
    return drawn


def bound(uses: Sequence[PortUse]) -> Iterator[tuple[str, PortUse]]:
    """The uses this run binds, each with its address: the ones to probe before anything starts."""
    return ((use.bind_host, use) for use in uses if use.bind_host is not None)


def engine_ports(
    profile: EngineProfile, origin: str, replica: int = 0, events_bound: bool = False
) -> list[PortUse]:
    """The ports engine PROFILE uses, its numbers set in the profile file ORIGIN (replica REPLICA of it adds
    REPLICA to each); EVENTS_BOUND: a router binds its KV-event port.

    Each is probed on the engine's host: vLLM binds the replay there or, for an engine on every interface,
    on loopback, which a probe of every interface covers."""
    name, host = profile.name, profile.host

    def source(field: str) -> str:
        return f"profile {origin}: {field}" + (f" + {replica}" if replica else "")

    uses = [PortUse(profile.port, f"engine {name!r}", source("port"), host)]
    if profile.kv_events_port is not None:
        events = PortUse(
            profile.kv_events_port,
            f"the KV events of engine {name!r}",
            source("kv_events_port"),
            host if events_bound else None,
        )
        uses.append(events)
    if profile.kv_events_replay_port is not None:
        replay = PortUse(
            profile.kv_events_replay_port,
            f"the KV-event replay of engine {name!r}",
            source("kv_events_replay_port"),
            host,
        )
        uses.append(replay)
    return uses
