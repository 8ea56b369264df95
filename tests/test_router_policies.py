"""Routing policies on hand-made engine states: what each picks, and why it says it picked it."""

from __future__ import annotations

import pytest

from kvtune.router.policies import EngineState, NoEngineReady, RoutedRequest, make_policy
from kvtune.router.prefix_index import block_hashes

BLOCK = 4
SYSTEM_A = list(range(100, 116))  # 4 blocks
SYSTEM_B = list(range(200, 216))


def engines(count: int = 2) -> list[EngineState]:
    return [EngineState(name=f"e{i}", url=f"http://127.0.0.1:{8000 + i}", capacity_blocks=64, ready=True)
            for i in range(count)]  # fmt: skip


def request(tokens: list[int], session: str | None = None) -> RoutedRequest:
    return RoutedRequest(blocks=block_hashes(tokens, BLOCK), session=session)


def test_round_robin_turns_over_ready_engines_only() -> None:
    fleet = engines(3)
    fleet[1].ready = False
    policy = make_policy("round_robin")
    assert [policy.choose(RoutedRequest(), fleet).engine.name for _ in range(4)] == ["e0", "e2", "e0", "e2"]
    for engine in fleet:
        engine.ready = False
    with pytest.raises(NoEngineReady, match="no engine is ready"):
        policy.choose(RoutedRequest(), fleet)


def test_least_loaded_counts_open_and_queued_requests_and_shares_ties() -> None:
    fleet = engines(2)
    fleet[0].in_flight, fleet[1].waiting = 1, 3
    assert make_policy("least_loaded").choose(RoutedRequest(), fleet).engine.name == "e0"
    fleet[0].in_flight = fleet[1].waiting = 0
    fleet[0].routed = 5  # e1 just rejoined: idle ties go to it until it has its share
    assert make_policy("least_loaded").choose(RoutedRequest(), fleet).engine.name == "e1"


def test_prefix_sends_a_shared_prefix_back_where_it_went() -> None:
    fleet = engines(2)
    policy = make_policy("prefix")
    first = policy.choose(request([*SYSTEM_A, 1, 2, 3, 4]), fleet)
    assert first.reason == "no_prefix_match"
    first.engine.sent.sent(request([*SYSTEM_A, 1, 2, 3, 4]).blocks)
    first.engine.in_flight = 1  # busier than the other, but within the bound
    again = policy.choose(request([*SYSTEM_A, 9, 9, 9, 9]), fleet)
    assert (again.engine, again.reason, again.matched_blocks) == (first.engine, "prefix_match", 4)
    other = policy.choose(request([*SYSTEM_B, 1, 2, 3, 4]), fleet)
    assert other.engine is not first.engine and other.reason == "no_prefix_match"


def test_a_hot_prefix_cannot_swamp_its_engine() -> None:
    fleet = engines(2)
    hot = request([*SYSTEM_A, 5, 5, 5, 5])
    fleet[0].sent.sent(hot.blocks)
    fleet[0].in_flight, fleet[1].in_flight = 4, 0  # mean 2: bound 1.5 * 2 + 1 = 4
    decision = make_policy("prefix").choose(hot, fleet)
    assert (decision.engine.name, decision.reason) == ("e1", "over_load_bound")


def test_kv_events_trusts_what_engines_report_and_falls_back_when_stale() -> None:
    fleet = engines(2)
    tokens = [*SYSTEM_A, 1, 2, 3, 4]
    # The router sent it to e0, but e0 reports having evicted it and e1 reports holding it.
    fleet[0].sent.sent(request(tokens).blocks)
    assert fleet[1].reported.stored([1, 2, 3, 4], None, SYSTEM_A, BLOCK)
    for engine in fleet:
        engine.reported_fresh = True
    policy = make_policy("kv_events")
    decision = policy.choose(request(tokens), fleet)
    assert (decision.engine.name, decision.reason, decision.matched_blocks) == ("e1", "kv_events_match", 4)
    fleet[1].reported.cleared()  # AllBlocksCleared: e1 is no longer preferred
    assert policy.choose(request(tokens), fleet).reason == "no_prefix_match"
    for engine in fleet:
        engine.reported_fresh = False  # a sequence gap: judge by what was sent
    stale = policy.choose(request(tokens), fleet)
    assert (stale.engine.name, stale.reason) == ("e0", "kv_events_stale")


def test_session_keeps_a_conversation_on_one_engine_and_moves_only_the_lost_ones() -> None:
    fleet = engines(3)
    policy = make_policy("session")
    placed = {
        f"user-{i}": policy.choose(RoutedRequest(session=f"user-{i}"), fleet).engine.name for i in range(60)
    }
    assert len(set(placed.values())) == 3, "sessions spread over the engines"
    assert all(policy.choose(RoutedRequest(session=s), fleet).engine.name == e for s, e in placed.items())
    fleet[2].ready = False
    moved = {s for s, e in placed.items() if policy.choose(RoutedRequest(session=s), fleet).engine.name != e}
    assert moved == {s for s, e in placed.items() if e == "e2"}
    assert policy.choose(RoutedRequest(), fleet).reason == "no_session"
