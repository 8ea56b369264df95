"""Replay search strategies over a measured table: how many trials each needs to find a near-best config.

A finished grid run knows every config's goodput, so a strategy can be replayed against it without an
engine: each config it proposes is looked up instead of measured. Over many seeds this gives the
search-efficiency benchmark's figures (benchmarks/search_efficiency.py).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, Field

from kvtune.sweep.records import config_id
from kvtune.sweep.strategies import Strategy, StrategyName, grid_configs, make_strategy


class StrategyReplay(BaseModel):
    """One strategy over every seed."""

    strategy: str
    trials: list[int | None] = Field(description="per seed: configs measured until one reached the target")
    median: float | None = Field(description="median of `trials`; None when most seeds never reached it")
    share_within_third: float = Field(description="share of seeds that reached it within grid_size / 3")


class ReplayReport(BaseModel):
    grid_size: int
    grid_best: float = Field(description="highest goodput in the table")
    within: float = Field(description="how far below the best still counts as found")
    target: float = Field(description="grid_best * (1 - within)")
    strategies: list[StrategyReplay]

    def result(self, strategy: str) -> StrategyReplay:
        return next(r for r in self.strategies if r.strategy == strategy)

    @property
    def tpe_passes(self) -> bool:
        """The benchmark's bar: TPE's median is within a third of the grid and below random's median."""
        tpe, rand = self.result("tpe").median, self.result("random").median
        return tpe is not None and tpe <= self.grid_size / 3 and (rand is None or tpe < rand)


def trials_to_reach(
    strategy: Strategy,
    table: dict[str, float | None],
    key: Callable[[dict[str, Any]], str],
    target: float,
    max_trials: int,
    free: frozenset[str] = frozenset(),
) -> int | None:
    """Configs the strategy proposes until one scores >= target; None if none did within max_trials.

    Every proposal counts as one trial, infeasible ones too (a failed engine start costs time as well),
    except `free` ones: configs the sweep prunes by KV arithmetic before any engine starts.
    A config missing from the table was never measured and is replayed as infeasible.
    """
    trial = 0
    while trial < max_trials:
        knobs = strategy.suggest()
        if knobs is None:
            return None
        goodput = table.get(key(knobs))
        strategy.observe(knobs, goodput)
        if key(knobs) in free:
            continue
        trial += 1
        if goodput is not None and goodput >= target:
            return trial
    return None


def replay(
    table_rows: Sequence[tuple[dict[str, Any], float | None]],
    candidates: dict[str, list[Any]],
    strategies: Sequence[StrategyName],
    seeds: range,
    within: float = 0.05,
    pruned: Sequence[dict[str, Any]] = (),
) -> ReplayReport:
    """Replay each strategy once per seed over the measured rows (knobs, goodput or None if infeasible).

    `pruned` configs cost no trial (the sweep rules them out before starting an engine), so the grid's
    size is the number of configs a grid sweep really measures.
    """
    table = {config_id(knobs): goodput for knobs, goodput in table_rows}
    free = frozenset(config_id(knobs) for knobs in pruned)
    grid_size = len(grid_configs(candidates)) - len(free)
    scores = [goodput for goodput in table.values() if goodput is not None]
    if not scores or max(scores) <= 0:
        raise ValueError("no config in the table met the SLO: there is no best to search for")
    best = max(scores)
    target = best * (1 - within)
    results = []
    for name in strategies:
        trials = [
            trials_to_reach(make_strategy(name, candidates, seed), table, config_id, target, grid_size, free)
            for seed in seeds
        ]
        # Seeds that never reached the target rank after every seed that did.
        median = statistics.median(math.inf if t is None else t for t in trials)
        within_third = sum(t is not None and t <= grid_size / 3 for t in trials) / len(trials)
        results.append(
            StrategyReplay(
                strategy=name,
                trials=trials,
                median=None if math.isinf(median) else float(median),
                share_within_third=within_third,
            )
        )
    return ReplayReport(grid_size=grid_size, grid_best=best, within=within, target=target, strategies=results)
