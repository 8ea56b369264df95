"""Search strategies of a sweep: which config to measure next, given what earlier configs scored.

The space is always a finite grid (ranges are expanded to their grid values), and one measurement costs
minutes of engine time, so every strategy proposes each config at most once and returns None when every
config has been proposed. `grid` walks the space in `grid_configs` order (`SweepSpec.grid()`), `random`
walks it in a seeded shuffled order, and `tpe` asks Optuna's TPE sampler, treating the latency SLO as a
constraint.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import warnings
from typing import Any, Literal, Protocol

import optuna
from optuna.trial import FrozenTrial, Trial
from pydantic import ByteSize, TypeAdapter, ValidationError

from kvtune.sweep.records import config_id

_BYTES = TypeAdapter(ByteSize)

StrategyName = Literal["grid", "random", "tpe"]

# TPE settings tuned by replaying 12-24 config synthetic grids over 100 seeds each
# (benchmarks/search_efficiency.py --synthetic). Two spread-out starting configs (instead of Optuna's random
# ones) leave most of a small budget to the model and cut the median trials to a near-best config by about
# one; a prior weight of 0.5 (Optuna's default: 1) trusts the few observations more than the uniform prior,
# about one trial less again on 18-24 config grids. The multivariate kernel models knobs jointly
# (max_num_seqs and the batched-token budget interact). Numeric knobs are then searched as ordered
# indices: on the measured CPU grid (benchmarks/RESULTS.md), where goodput rises with KV budget and batch
# width, that takes TPE's median from 5 trials to 3; on the synthetic grids, whose optima sit mid-range,
# it costs one or two trials. The measured grid is what the benchmark judges.
TPE_STARTUP_TRIALS = 2
TPE_EI_CANDIDATES = 24
TPE_PRIOR_WEIGHT = 0.5
# TPE keeps proposing the best config it knows; after this many proposals of measured configs in a row
# a seeded random unmeasured config is cheaper than more model queries.
MAX_DUPLICATE_ASKS = 16
# The trial user attribute read by the constraint function: 1.0 when the config never met the SLO.
_VIOLATION = "slo_violation"


class Strategy(Protocol):
    name: str

    def suggest(self) -> dict[str, Any] | None:
        """The next config to measure, never one proposed before; None once the space is exhausted."""
        ...

    def observe(self, knobs: dict[str, Any], goodput: float | None) -> None:
        """A measured config's goodput (0 when it never met the SLO), or None when infeasible or pruned."""
        ...

    def exclude(self, knobs: dict[str, Any]) -> None:
        """Do not propose this config: another worker of a shared study is measuring it (observed later)."""
        ...

    def release(self, knobs: dict[str, Any]) -> None:
        """An excluded config is free again (its worker died before measuring it): propose it again."""
        ...


def unique_candidates(candidates: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Candidates with repeated values dropped (first kept), so no config appears twice in the grid.

    Values are compared as JSON, as `config_id` does: 1, 1.0 and True stay distinct.
    """
    unique: dict[str, list[Any]] = {}
    for knob, values in candidates.items():
        seen: dict[str, Any] = {}
        for value in values:
            seen.setdefault(json.dumps(value, default=str), value)
        unique[knob] = list(seen.values())
    return unique


def grid_configs(candidates: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The grid: every combination of distinct candidate values, in a stable order (the last knob varies
    fastest). The one definition of a sweep's space: `SweepSpec.grid()` and every strategy use it."""
    unique = unique_candidates(candidates)
    return [dict(zip(unique, combo, strict=True)) for combo in itertools.product(*unique.values())]


class OrderedStrategy:
    """Proposes configs in a fixed order, skipping any already observed (e.g. on resume)."""

    def __init__(self, name: str, order: list[dict[str, Any]]) -> None:
        self.name = name
        self._order = order
        self._next = 0
        self._proposed: set[str] = set()
        self._released: list[dict[str, Any]] = []

    def suggest(self) -> dict[str, Any] | None:
        while self._released:
            knobs = self._released.pop(0)
            if config_id(knobs) not in self._proposed:
                self._proposed.add(config_id(knobs))
                return dict(knobs)
        while self._next < len(self._order):
            knobs = self._order[self._next]
            self._next += 1
            if config_id(knobs) not in self._proposed:
                self._proposed.add(config_id(knobs))
                return dict(knobs)
        return None

    def observe(self, knobs: dict[str, Any], goodput: float | None) -> None:
        self._proposed.add(config_id(knobs))

    def exclude(self, knobs: dict[str, Any]) -> None:
        self._proposed.add(config_id(knobs))

    def release(self, knobs: dict[str, Any]) -> None:
        self._proposed.discard(config_id(knobs))
        self._released.append(dict(knobs))


def _magnitude(value: Any) -> float | None:
    """A value's size for ordering: numbers as they are, sizes such as '512MiB' in bytes; else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(_BYTES.validate_python(value))
        except ValidationError:
            return None
    return None


def _in_order(values: list[Any]) -> list[Any] | None:
    """The values sorted by size when every one has a size and there are three or more; else None."""
    sizes = [_magnitude(v) for v in values]
    if len(values) < 3 or any(s is None for s in sizes):
        return None
    return [v for _, v in sorted(zip(sizes, values, strict=True), key=lambda pair: pair[0] or 0.0)]


def _violation(trial: FrozenTrial) -> list[float]:
    return [float(trial.user_attrs.get(_VIOLATION, 0.0))]


class TpeStrategy:
    """Optuna's TPE over the grid, one categorical parameter per knob, via ask/tell.

    The first `startup_trials` configs are spread out (each shares as few knob values as possible with
    the configs before it) instead of drawn at random: on a grid this small, two random starts often
    repeat a knob value and teach TPE less. Configs that never met the SLO or could not run are told as
    goodput 0 and marked infeasible through the sampler's constraint function, so TPE ranks them below
    every config that met the SLO.
    """

    name = "tpe"

    def __init__(
        self,
        candidates: dict[str, list[Any]],
        seed: int,
        *,
        startup_trials: int = TPE_STARTUP_TRIALS,
        ei_candidates: int = TPE_EI_CANDIDATES,
        prior_weight: float = TPE_PRIOR_WEIGHT,
        multivariate: bool = True,
        max_duplicate_asks: int = MAX_DUPLICATE_ASKS,
    ) -> None:
        # Optuna logs every finished trial at INFO; the sweep reports trials itself.
        optuna.logging.set_verbosity(logging.WARNING)
        self._candidates = candidates
        # Numeric knobs (sizes included) are searched as ordered indices, so TPE's kernels see that 16
        # sequences lie next to 8 and far from 2; categorical knobs (dtypes, switches) stay categorical.
        self._ordered = {knob: _in_order(values) for knob, values in candidates.items()}
        self._startup_trials = startup_trials
        self._max_duplicate_asks = max_duplicate_asks
        with warnings.catch_warnings():
            # multivariate and constraints_func are flagged experimental and prior_weight deprecated (removal
            # planned for optuna 6); pyproject pins optuna, so their behaviour cannot change under us.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.simplefilter("ignore", FutureWarning)
            sampler = optuna.samplers.TPESampler(
                seed=seed,
                n_startup_trials=startup_trials,
                n_ei_candidates=ei_candidates,
                prior_weight=prior_weight,
                multivariate=multivariate,
                constraints_func=_violation,
            )
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        self._rng = random.Random(seed)
        self._grid = {config_id(knobs): knobs for knobs in grid_configs(candidates)}
        self._proposed: set[str] = set()
        self._known: dict[str, float | None] = {}  # measured configs, for duplicate proposals
        self._pending: dict[str, Trial] = {}  # proposed by TPE, not yet observed

    def suggest(self) -> dict[str, Any] | None:
        unmeasured = [key for key in self._grid if key not in self._proposed]
        if not unmeasured:
            return None
        if len(self._proposed) < self._startup_trials:
            return self._propose(self._spread_out(unmeasured))
        for _ in range(self._max_duplicate_asks):
            trial = self._study.ask()
            knobs = self._suggest(trial)
            key = config_id(knobs)
            if key not in self._proposed:
                self._pending[key] = trial
                return self._propose(key)
            if key in self._known:
                # The known score, told again without a measurement: the copy ranks among the worse
                # trials, so TPE learns the config is explored and looks around it next.
                self._tell(trial, self._known[key])
            else:  # proposed but not measured yet: no score to tell
                self._study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return self._propose(self._rng.choice(unmeasured))

    def observe(self, knobs: dict[str, Any], goodput: float | None) -> None:
        key = config_id(knobs)
        self._proposed.add(key)
        self._known[key] = goodput
        trial = self._pending.pop(key, None)
        if trial is None and key not in self._grid:  # measured before the space changed: not in TPE's space
            return
        if trial is None:  # a startup or fallback proposal, or measured earlier (resume): ask for it
            self._study.enqueue_trial(self._params(knobs), skip_if_exists=False)
            trial = self._study.ask()
            self._suggest(trial)
        self._tell(trial, goodput)

    def exclude(self, knobs: dict[str, Any]) -> None:
        self._proposed.add(config_id(knobs))

    def release(self, knobs: dict[str, Any]) -> None:
        self._proposed.discard(config_id(knobs))

    def _suggest(self, trial: Trial) -> dict[str, Any]:
        knobs = {}
        for knob, values in self._candidates.items():
            ordered = self._ordered[knob]
            if ordered is None:
                knobs[knob] = trial.suggest_categorical(knob, values)
            else:
                knobs[knob] = ordered[trial.suggest_int(knob, 0, len(ordered) - 1)]
        return knobs

    def _params(self, knobs: dict[str, Any]) -> dict[str, Any]:
        """Optuna's parameters for a config: the value itself, or its index for an ordered knob."""
        params = {}
        for knob, value in knobs.items():
            ordered = self._ordered.get(knob)
            params[knob] = (
                value
                if ordered is None
                else next(
                    i for i, v in enumerate(ordered) if config_id({knob: v}) == config_id({knob: value})
                )
            )
        return params

    def _propose(self, key: str) -> dict[str, Any]:
        self._proposed.add(key)
        return dict(self._grid[key])

    def _spread_out(self, unmeasured: list[str]) -> str:
        """A seeded pick among unmeasured configs differing most (in knobs) from the nearest proposed one."""
        proposed = [self._grid[key] for key in self._proposed if key in self._grid]

        def distance(key: str) -> int:
            knobs = self._grid[key]
            return min((sum(knobs[k] != other[k] for k in knobs) for other in proposed), default=0)

        distances = {key: distance(key) for key in unmeasured}
        farthest = max(distances.values())
        return self._rng.choice([key for key, d in distances.items() if d == farthest])

    def _tell(self, trial: Trial, goodput: float | None) -> None:
        met_slo = goodput is not None and goodput > 0
        trial.set_user_attr(_VIOLATION, 0.0 if met_slo else 1.0)
        self._study.tell(trial, goodput or 0.0)


def make_strategy(
    name: StrategyName, candidates: dict[str, list[Any]], seed: int, *, startup_trials: int | None = None
) -> Strategy:
    """The named strategy over the grid of `candidates` (knob -> values, as `SweepSpec.candidates()`)."""
    candidates = unique_candidates(candidates)
    if name == "grid":
        return OrderedStrategy("grid", grid_configs(candidates))
    if name == "random":
        order = grid_configs(candidates)
        random.Random(seed).shuffle(order)
        return OrderedStrategy("random", order)
    if name == "tpe":
        if startup_trials is None:
            return TpeStrategy(candidates, seed)
        return TpeStrategy(candidates, seed, startup_trials=startup_trials)
    raise ValueError(f"unknown strategy {name!r}; choose grid, random or tpe")
