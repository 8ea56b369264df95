"""How the router picks an engine for a request: round_robin, least_loaded, prefix, kv_events, session.

Every policy sees only ready engines and returns a Decision that says why it chose (the router counts
decisions by reason, so a dashboard shows how often a prefix really decided). The prefix policies bound
load the way consistent hashing with bounded loads does: an engine already carrying more than
`load_factor` times the mean (plus one) cannot take a request by prefix, so one hot prefix cannot swamp it;
the request then goes to the least loaded engine, which will hold that prefix next.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

from kvtune.router.prefix_index import ReportedBlocks, SentBlocks

PolicyName = Literal["round_robin", "least_loaded", "prefix", "kv_events", "session"]
ROUTER_POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)
Reason = Literal[
    "round_robin", "least_loaded", "prefix_match", "no_prefix_match", "over_load_bound", "kv_events_match",
    "kv_events_stale", "session", "no_session",
]  # fmt: skip


@dataclass
class EngineState:
    """What the router knows of one engine: readiness, load and the two views of its cache."""

    name: str
    url: str
    capacity_blocks: int
    ready: bool = False
    in_flight: int = 0  # requests the router has open on it
    waiting: float = 0.0  # vllm:num_requests_waiting, scraped
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, scraped (0..1)
    routed: int = 0  # requests the router has sent it, ever
    sent: SentBlocks = field(init=False)
    reported: ReportedBlocks = field(default_factory=ReportedBlocks)
    reported_fresh: bool = False  # KV events subscribed with no gap since the view was (re)built

    def __post_init__(self) -> None:
        self.sent = SentBlocks(self.capacity_blocks)

    def took(self, blocks: Sequence[int]) -> None:
        """The engine accepted a request whose prompt is BLOCKS: both views hold them now (the reported one
        until the engine's own events say otherwise)."""
        self.sent.sent(blocks)
        self.reported.expect(blocks)

    @property
    def load(self) -> float:
        """Requests on the engine and queued in it; KV usage breaks ties between equally busy engines."""
        return self.in_flight + self.waiting + self.kv_usage


@dataclass(frozen=True)
class RoutedRequest:
    """What a policy may look at: the prompt's block chain and the session key, when there is one."""

    blocks: Sequence[int] = ()
    session: str | None = None


@dataclass(frozen=True)
class Decision:
    engine: EngineState
    reason: Reason
    matched_blocks: int = 0


class NoEngineReady(RuntimeError):
    """Every engine is down, restarting or unready."""


class Policy(Protocol):
    name: PolicyName

    def choose(self, request: RoutedRequest, engines: Sequence[EngineState]) -> Decision: ...


def _ready(engines: Sequence[EngineState]) -> list[EngineState]:
    ready = [engine for engine in engines if engine.ready]
    if not ready:
        raise NoEngineReady(f"no engine is ready ({', '.join(e.name for e in engines) or 'none configured'})")
    return ready


def least_loaded(engines: Sequence[EngineState]) -> EngineState:
    # Between equally loaded engines (idle ones, under sequential traffic) the one sent fewest requests:
    # a rejoining engine gets its share instead of the first name winning every tie.
    return min(engines, key=lambda engine: (engine.load, engine.routed, engine.name))


@dataclass
class RoundRobin:
    name: PolicyName = "round_robin"
    _turn: itertools.count[int] = field(default_factory=itertools.count)

    def choose(self, request: RoutedRequest, engines: Sequence[EngineState]) -> Decision:
        ready = _ready(engines)
        return Decision(ready[next(self._turn) % len(ready)], "round_robin")


@dataclass
class LeastLoaded:
    name: PolicyName = "least_loaded"

    def choose(self, request: RoutedRequest, engines: Sequence[EngineState]) -> Decision:
        return Decision(least_loaded(_ready(engines)), "least_loaded")


def _within_bound(engines: Sequence[EngineState], load_factor: float) -> list[EngineState]:
    mean = sum(engine.in_flight for engine in engines) / len(engines)
    bound = load_factor * mean + 1
    return [engine for engine in engines if engine.in_flight < bound]


@dataclass
class Prefix:
    """Longest chain of blocks the router has sent to each engine, under the load bound."""

    load_factor: float = 1.5
    name: PolicyName = "prefix"

    def match(self, engine: EngineState, blocks: Sequence[int]) -> int:
        return engine.sent.match(blocks)

    def matched_reason(self, engine: EngineState) -> Reason:
        return "prefix_match"

    def choose(self, request: RoutedRequest, engines: Sequence[EngineState]) -> Decision:
        ready = _ready(engines)
        if not request.blocks:
            return Decision(least_loaded(ready), "no_prefix_match")
        candidates = _within_bound(ready, self.load_factor)
        scored = [(self.match(engine, request.blocks), engine) for engine in candidates]
        best = max((count for count, _ in scored), default=0)
        if best == 0:
            any_match = any(self.match(engine, request.blocks) for engine in ready)
            return Decision(least_loaded(ready), "over_load_bound" if any_match else "no_prefix_match")
        chosen = least_loaded([engine for count, engine in scored if count == best])
        return Decision(chosen, self.matched_reason(chosen), best)


@dataclass
class KvEvents(Prefix):
    """The same decision from what each engine reports holding; an engine whose event stream has a gap
    (or was never subscribed) is judged by what the router sent it until its view is rebuilt."""

    name: PolicyName = "kv_events"

    def match(self, engine: EngineState, blocks: Sequence[int]) -> int:
        return engine.reported.match(blocks) if engine.reported_fresh else engine.sent.match(blocks)

    def matched_reason(self, engine: EngineState) -> Reason:
        return "kv_events_match" if engine.reported_fresh else "kv_events_stale"


@dataclass
class Session:
    """A session (a header or the request's `user`) keeps to one engine: rendezvous hashing, so an engine
    joining or leaving moves only the sessions that were on it."""

    name: PolicyName = "session"

    def choose(self, request: RoutedRequest, engines: Sequence[EngineState]) -> Decision:
        ready = _ready(engines)
        if not request.session:
            return Decision(least_loaded(ready), "no_session")
        key = request.session.encode()

        def weight(engine: EngineState) -> bytes:
            return hashlib.blake2b(key + b"\0" + engine.name.encode(), digest_size=8).digest()

        return Decision(max(ready, key=weight), "session")


def make_policy(name: PolicyName, load_factor: float = 1.5) -> Policy:
    policies: dict[PolicyName, Policy] = {
        "round_robin": RoundRobin(),
        "least_loaded": LeastLoaded(),
        "prefix": Prefix(load_factor=load_factor),
        "kv_events": KvEvents(load_factor=load_factor),
        "session": Session(),
    }
    return policies[name]
