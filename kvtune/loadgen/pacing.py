"""Open-loop arrivals: the intended send time of every request, fixed before the run starts.

Latency is measured from the intended time, so requests that wait for a free client slot behind a slow
server count that wait (no coordinated omission). The times come from a rate (evenly spaced or Poisson) or
from a trace's own arrivals; either way a user sleeps until its request's time and never sends it earlier.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

# closed: each user sends its next request when its answer ends; constant / poisson: open loop at a rate;
# trace: open loop at a trace's own arrival times.
Arrival = Literal["closed", "constant", "poisson", "trace"]
ARRIVALS: tuple[str, ...] = get_args(Arrival)


@dataclass
class ArrivalSchedule:
    """Intended send times from `start` (the first request's time if left at 0): at `rate` per second
    (`constant` or `poisson`), or at the given `offsets` (`trace`: request i is due offsets[i] seconds after
    the start). `limit` ends the schedule after that many requests (a trace's length); None: never."""

    rate: float = 0.0
    kind: Literal["constant", "poisson", "trace"] = "constant"
    start: float = 0.0
    seed: int = 0
    limit: int | None = None
    offsets: Sequence[float] = ()
    _offsets: list[float] = field(init=False, default_factory=list)
    _count: int = field(init=False, default=0)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.kind == "trace":
            given = list(self.offsets)
            if any(not math.isfinite(t) or t < 0 for t in given) or any(
                b < a for a, b in itertools.pairwise(given)
            ):
                raise ValueError("trace arrival offsets must be finite, 0 or more and in order")
            self._offsets = given
            self.limit = len(given) if self.limit is None else min(self.limit, len(given))
        elif not self.rate > 0:
            raise ValueError(f"arrival rate must be positive, got {self.rate}")
        self._rng = random.Random(self.seed)

    def reset(self) -> None:
        """Start over (a new run from Locust's web UI): the same times, from the next first request."""
        self.start, self._count = 0.0, 0

    def next_index(self) -> int:
        """Claim the next request slot; `ended(index)` says whether the schedule still holds it."""
        if not self.start:
            self.start = time.time()
        index = self._count
        self._count += 1
        return index

    def ended(self, index: int) -> bool:
        return self.limit is not None and index >= self.limit

    def time_of(self, index: int) -> float:
        """Intended send time of slot `index` (wall clock)."""
        if self.ended(index):
            raise IndexError(f"the schedule ends after {self.limit} requests")
        while len(self._offsets) <= index:
            previous = self._offsets[-1] if self._offsets else None
            gap = 1.0 / self.rate if self.kind == "constant" else self._rng.expovariate(self.rate)
            self._offsets.append(0.0 if previous is None else previous + gap)
        return self.start + self._offsets[index]

    def next_slot(self) -> tuple[int, float]:
        """(request index, intended send time) of the next request."""
        index = self.next_index()
        return index, self.time_of(index)

    def times_before(self, end: float) -> Iterator[float]:
        """The intended time of every slot due before `end`, in order."""
        for index in itertools.count():
            if self.ended(index) or (moment := self.time_of(index)) >= end:
                return
            yield moment


def schedule_for(
    arrival: Arrival, rate: float | None, seed: int = 0, offsets: Sequence[float] | None = None
) -> ArrivalSchedule | None:
    """A run's pacing: None for a closed loop; a trace's own OFFSETS; else RATE per second, for at most the
    trace's requests when OFFSETS (a trace's arrivals) are given."""
    if arrival == "closed":
        return None
    if arrival == "trace":
        if offsets is None:
            raise ValueError("arrival 'trace' paces a trace's own arrival times; this workload has none")
        return ArrivalSchedule(kind="trace", offsets=offsets)
    if rate is None:
        raise ValueError(f"arrival {arrival!r} needs a rate (requests per second)")
    return ArrivalSchedule(rate, arrival, seed=seed, limit=None if offsets is None else len(offsets))
