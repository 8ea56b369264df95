"""Search strategies propose every config of the grid exactly once; TPE finds a near-best one sooner."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvtune.sweep.records import config_id
from kvtune.sweep.replay import replay, trials_to_reach
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.strategies import Strategy, StrategyName, make_strategy

REPO = Path(__file__).resolve().parent.parent
BASE_PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
STRATEGIES: list[StrategyName] = ["grid", "random", "tpe"]
SPACE: dict[str, list[Any]] = {
    "max_num_seqs": [2, 4, 8, 16],
    "max_num_batched_tokens": [512, 1024, 2048],
    "enable_prefix_caching": [False, True],
}


def landscape(knobs: dict[str, Any]) -> float | None:
    """Goodput peaking at 8 sequences with a large prefill budget; a pruned and a hopeless corner."""
    seqs, tokens = knobs["max_num_seqs"], knobs["max_num_batched_tokens"]
    prefix = knobs["enable_prefix_caching"]
    if seqs == 16 and not prefix:
        return None
    if seqs == 2 and tokens == 2048:
        return 0.0
    per_seqs = {2: 1.0, 4: 1.6, 8: 2.5, 16: 2.0}[seqs]
    budget = 1 + (0.15 if seqs >= 8 else -0.1) * math.log2(tokens / 512)
    return round(per_seqs * budget * (1.3 if prefix else 1.0), 3)


def drain(strategy: Strategy, score: Any = landscape) -> list[dict[str, Any]]:
    """Every config the strategy proposes, each observed with its score, until it says the space is done."""
    proposed = []
    while (knobs := strategy.suggest()) is not None:
        proposed.append(knobs)
        strategy.observe(knobs, score(knobs))
        assert len(proposed) <= 100, "the strategy never stopped"
    return proposed


@pytest.mark.usefixtures("fake_host")  # AVX-512: fp8 KV stays in the grid
def test_grid_walks_the_spec_grid_in_order() -> None:
    spec = SweepSpec.model_validate(
        {
            "name": "t",
            "base_profile": str(BASE_PROFILE),
            "space": {
                "kv_cache_dtype": ["auto", "fp8"],
                "max_num_seqs": [4, 8],
                "gpu_memory_utilization": {"min": 0.5, "max": 0.7, "step": 0.1},
            },
            "slo": {"ttft_p99_s": 1.5},
        }
    )
    # The last knob varies fastest; the range expands to 0.5, 0.6, 0.7 (rounded, not 0.6000000000000001).
    expected = [
        ("auto", 4, 0.5), ("auto", 4, 0.6), ("auto", 4, 0.7),
        ("auto", 8, 0.5), ("auto", 8, 0.6), ("auto", 8, 0.7),
        ("fp8", 4, 0.5), ("fp8", 4, 0.6), ("fp8", 4, 0.7),
        ("fp8", 8, 0.5), ("fp8", 8, 0.6), ("fp8", 8, 0.7),
    ]  # fmt: skip
    walked = drain(make_strategy("grid", spec.candidates(), seed=0), lambda _: 1.0)
    knob_names = ("kv_cache_dtype", "max_num_seqs", "gpu_memory_utilization")
    assert [tuple(knobs[name] for name in knob_names) for knobs in walked] == expected
    assert all(list(knobs) == list(knob_names) for knobs in walked)
    assert spec.grid() == walked  # the spec's own grid is the order the sweep reports and resumes in


def test_random_is_a_seeded_permutation_of_the_grid() -> None:
    grid = drain(make_strategy("grid", SPACE, seed=0))
    first = drain(make_strategy("random", SPACE, seed=1))
    assert first == drain(make_strategy("random", SPACE, seed=1))
    assert first != drain(make_strategy("random", SPACE, seed=2))
    assert first != grid
    assert sorted(map(config_id, first)) == sorted(map(config_id, grid))


@pytest.mark.parametrize("name", STRATEGIES)
def test_each_config_exactly_once_then_none(name: StrategyName) -> None:
    strategy = make_strategy(name, SPACE, seed=3)
    proposed = drain(strategy)
    assert len(proposed) == 24
    assert len({config_id(knobs) for knobs in proposed}) == 24
    assert strategy.suggest() is None
    assert strategy.suggest() is None


@pytest.mark.parametrize("name", STRATEGIES)
def test_configs_observed_before_are_not_proposed(name: StrategyName) -> None:
    """A resumed sweep tells the strategy what it measured already; those are never proposed again."""
    strategy = make_strategy(name, SPACE, seed=0)
    done = [{"max_num_seqs": 8, "max_num_batched_tokens": 2048, "enable_prefix_caching": True}]
    done.append({"max_num_seqs": 2, "max_num_batched_tokens": 512, "enable_prefix_caching": False})
    for knobs in done:
        strategy.observe(knobs, landscape(knobs))
    proposed = {config_id(knobs) for knobs in drain(strategy)}
    assert len(proposed) == 22
    assert not proposed & {config_id(knobs) for knobs in done}


@pytest.mark.parametrize("name", STRATEGIES)
def test_value_types_survive(name: StrategyName) -> None:
    candidates: dict[str, list[Any]] = {
        "enable_prefix_caching": [True, False],
        "kv_cache_dtype": ["auto", "fp8"],
        "gpu_memory_utilization": [0.5, 0.75],
        "max_num_seqs": [1, 2],
    }
    proposed = drain(make_strategy(name, candidates, seed=0), lambda knobs: None)
    assert len(proposed) == 16
    for knobs in proposed:
        assert list(knobs) == list(candidates)
        for knob, value in knobs.items():
            assert value in candidates[knob]
            assert type(value) is type(candidates[knob][0]), (knob, value)


def test_repeated_candidate_values_are_measured_once() -> None:
    candidates: dict[str, list[Any]] = {"max_num_seqs": [4, 4, 8], "block_size": [16, 32]}
    for name in STRATEGIES:
        assert len(drain(make_strategy(name, candidates, seed=0), lambda _: 1.0)) == 4


def test_trials_to_reach_counts_every_proposal() -> None:
    candidates: dict[str, list[Any]] = {"max_num_seqs": [2, 4], "block_size": [16, 32]}
    # grid order: (2, 16) (2, 32) (4, 16) (4, 32); (2, 32) is missing from the table: replayed as infeasible
    table: dict[str, float | None] = {
        config_id({"max_num_seqs": 2, "block_size": 16}): 1.0,
        config_id({"max_num_seqs": 4, "block_size": 16}): None,
        config_id({"max_num_seqs": 4, "block_size": 32}): 3.0,
    }

    def grid() -> Strategy:
        return make_strategy("grid", candidates, seed=0)

    assert trials_to_reach(grid(), table, config_id, target=1.0, max_trials=4) == 1
    assert trials_to_reach(grid(), table, config_id, target=2.9, max_trials=4) == 4
    assert trials_to_reach(grid(), table, config_id, target=2.9, max_trials=3) is None
    assert trials_to_reach(grid(), table, config_id, target=5.0, max_trials=10) is None


def test_replay_report_on_a_hand_made_table() -> None:
    candidates: dict[str, list[Any]] = {"max_num_seqs": [2, 4, 8]}
    rows = [({"max_num_seqs": 2}, 1.0), ({"max_num_seqs": 4}, 1.96), ({"max_num_seqs": 8}, 2.0)]
    report = replay(rows, candidates, ["grid"], range(3), within=0.05)
    assert (report.grid_size, report.grid_best, report.target) == (3, 2.0, 1.9)
    grid = report.result("grid")
    assert grid.trials == [2, 2, 2]  # 1.96 is within 5% of the best
    assert (grid.median, grid.share_within_third) == (2.0, 0.0)
    with pytest.raises(ValueError, match="no config in the table met the SLO"):
        replay([({"max_num_seqs": 2}, 0.0)], candidates, ["grid"], range(1))


def test_tpe_finds_a_near_best_config_sooner_than_random() -> None:
    rows = [(knobs, landscape(knobs)) for knobs in drain(make_strategy("grid", SPACE, seed=0))]
    report = replay(rows, SPACE, ["random", "tpe"], range(60), within=0.05)
    tpe, rand = report.result("tpe"), report.result("random")
    assert tpe.median is not None and rand.median is not None
    assert tpe.median < rand.median
    assert tpe.share_within_third > rand.share_within_third


def test_pruned_configs_cost_no_replayed_trial() -> None:
    """The sweep skips KV-pruned configs before any engine starts; the replay must not charge for them."""
    candidates: dict[str, list[Any]] = {"max_num_seqs": [16, 2, 4]}
    table = {config_id({"max_num_seqs": 16}): None, config_id({"max_num_seqs": 2}): 1.0,
             config_id({"max_num_seqs": 4}): 2.0}  # fmt: skip
    pruned = frozenset({config_id({"max_num_seqs": 16})})
    grid = make_strategy("grid", candidates, 0)
    assert trials_to_reach(grid, table, config_id, 2.0, 3, free=pruned) == 2
    assert trials_to_reach(make_strategy("grid", candidates, 0), table, config_id, 2.0, 3) == 3
