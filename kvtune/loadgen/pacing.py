"""Open-loop arrivals: the intended send time of every request, fixed before the run starts.

Latency is measured from the intended time, so requests that wait for a free client slot behind a slow
server count that wait (no coordinated omission).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

Arrival = Literal["closed", "constant", "poisson"]


@dataclass
class ArrivalSchedule:
    """Hands out intended send times, one per request, at `rate` per second from `start`."""

    rate: float
    kind: Literal["constant", "poisson"] = "constant"
    start: float = 0.0
    seed: int = 0
    _next: float = field(init=False, default=0.0)
    _count: int = field(init=False, default=0)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"arrival rate must be positive, got {self.rate}")
        self._rng = random.Random(self.seed)
        self._next = self.start

    def next_slot(self) -> tuple[int, float]:
        """(request index, intended send time) of the next request."""
        slot = (self._count, self._next)
        self._count += 1
        gap = 1.0 / self.rate if self.kind == "constant" else self._rng.expovariate(self.rate)
        self._next += gap
        return slot
