"""The load runner's accounting, without Locust or an engine: which open-loop slots went unsent."""

from __future__ import annotations

from typing import Any

from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.loadgen.runner import LoadSpec, _unsent


def sent(schedule: ArrivalSchedule, count: int, source: str = "samples.1.jsonl") -> list[dict[str, Any]]:
    return [{"intended": schedule.time_of(i), "_source": source} for i in range(count)]


def test_poisson_slots_are_counted_from_the_schedule_not_rate_times_duration() -> None:
    spec = LoadSpec(url="http://127.0.0.1:1", arrival="poisson", rate=0.15, seed=3)
    schedule = ArrivalSchedule(0.15, "poisson", start=1000.0, seed=3)
    start, end = 1003.0, 1023.0
    due = [i for i in range(50) if start <= schedule.time_of(i) < end]
    last = max(i for i in range(50) if schedule.time_of(i) < end)
    everything = sent(schedule, last + 1)
    # Every due slot was sent: none unsent, whatever 0.15 x 20 s rounds to.
    assert _unsent(spec, everything, start, end) == 0
    # The run ended before the last due slot was sent: exactly that one is unsent.
    assert due, "the seeded schedule should put requests in the window"
    assert _unsent(spec, everything[: due[-1]], start, end) == 1


def test_closed_loop_never_has_unsent_requests() -> None:
    spec = LoadSpec(url="http://127.0.0.1:1", arrival="closed")
    assert _unsent(spec, [], 0.0, 10.0) == 0
