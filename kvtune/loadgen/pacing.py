"""Open-loop arrivals: the intended send time of every request, fixed before the run starts.

Latency is measured from the intended time, so requests that wait for a free client slot behind a slow
server count that wait (no coordinated omission).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Literal

Arrival = Literal["closed", "constant", "poisson"]


@dataclass
class ArrivalSchedule:
    """Intended send times at `rate` per second from `start` (the first request's time if left at 0)."""

    rate: float
    kind: Literal["constant", "poisson"] = "constant"
    start: float = 0.0
    seed: int = 0
    _offsets: list[float] = field(init=False, default_factory=list)
    _count: int = field(init=False, default=0)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"arrival rate must be positive, got {self.rate}")
        self._rng = random.Random(self.seed)

    def next_index(self) -> int:
        """Claim the next request slot."""
        if not self.start:
            self.start = time.time()
        index = self._count
        self._count += 1
        return index

    def time_of(self, index: int) -> float:
        """Intended send time of slot `index` (wall clock)."""
        while len(self._offsets) <= index:
            previous = self._offsets[-1] if self._offsets else None
            gap = 1.0 / self.rate if self.kind == "constant" else self._rng.expovariate(self.rate)
            self._offsets.append(0.0 if previous is None else previous + gap)
        return self.start + self._offsets[index]

    def next_slot(self) -> tuple[int, float]:
        """(request index, intended send time) of the next request."""
        index = self.next_index()
        return index, self.time_of(index)
