"""Ranking configs by bracketed goodput: decided when one passed a rate the other was decided to miss, by
margin at the highest rate both passed when their brackets overlap, and a censored goodput named as a lower
bound wherever it is shown."""

from __future__ import annotations

import json
from collections.abc import Callable

from kvtune.loadgen.results import LoadResult
from kvtune.sweep import ranking
from kvtune.sweep.goodput import search_goodput
from kvtune.sweep.records import ConfigSummary, TrialRecord
from kvtune.sweep.spec import LoadSearch, Slo
from kvtune.sweep.summary import summarize_config
from kvtune.sweep.trial import step_record
from tests.builders import load_result

SLO = Slo(ttft_p99_s=1.0)


def searched(
    config_id: str, ttft_at: Callable[[float], float | None], plan: LoadSearch, repeat: int = 1
) -> TrialRecord:
    """A config's goodput search on a scripted engine whose TTFT at each rate is `ttft_at(rate)`."""

    def measure(rate: float, _window: int, _seconds: float, *, continues: bool = False) -> LoadResult:
        ttft = ttft_at(rate)
        # None: two quick requests, too few to bound a p99 from above, never over it: undecided.
        return load_result(0.5, rate=rate, requests=2) if ttft is None else load_result(ttft, rate=rate)

    search = search_goodput(measure, SLO, plan)
    return TrialRecord(
        trial=repeat,
        config_id=config_id,
        knobs={"max_num_seqs": config_id},
        repeat=repeat,
        status="done",
        goodput=search.goodput,
        steps=[step_record(step) for step in search.steps],
    )


def config(config_id: str, ttft_at: Callable[[float], float | None], plan: LoadSearch) -> ConfigSummary:
    return summarize_config([searched(config_id, ttft_at, plan)])


LADDER = LoadSearch(start_rate=1, max_rate=4, growth=2, bisect_steps=0)


def edge(limit: float, ttft: float = 0.5) -> Callable[[float], float]:
    """An engine meeting the 1 s target with `ttft` up to `limit` req/s and missing it by far above."""
    return lambda rate: ttft if rate <= limit else 5.0


def test_a_pass_above_the_other_s_decided_miss_decides_the_ranking() -> None:
    fast, slow = config("fast", edge(8), LADDER), config("slow", edge(2), LADDER)
    # fast climbed past max_rate 4: passed 8, missed 16; slow passed 2, missed 4.
    assert (fast.mean_goodput, fast.goodput_ceiling) == (8, 16)
    assert (slow.mean_goodput, slow.goodput_ceiling) == (2, 4)
    assert not fast.censored and not slow.censored
    assert [c.config_id for c in ranking.rank([slow, fast])] == ["fast", "slow"]
    (comparison,) = ranking.comparisons(ranking.rank([slow, fast]))
    assert comparison.decided and comparison.first == "fast"
    assert "fast passed 8 req/s" in comparison.why


def test_overlapping_brackets_are_ranked_by_margin_and_not_called_decided() -> None:
    # Both pass 1, 2 and 4 and are capped at 4: censored, brackets [4, open) overlap. At 4 req/s one
    # stayed at 0.9 s of the 1 s target (10% inside), the other at 0.4 s (60%): the roomier ranks first,
    # though its goodput is no higher.
    capped = LADDER.model_copy(update={"rate_cap": 4})
    tight = config("tight", lambda rate: 0.9, capped)
    roomy = config("roomy", lambda rate: 0.4, capped)
    assert tight.censored and roomy.censored and tight.mean_goodput == roomy.mean_goodput == 4
    ranked = ranking.rank([tight, roomy])
    assert [c.config_id for c in ranked] == ["roomy", "tight"]
    (comparison,) = ranking.comparisons(ranked)
    assert not comparison.decided
    assert "not decided" in comparison.why and "ranked by margin at 4 req/s" in comparison.why
    assert "roomy's tightest target 60% inside it, tight's 10%" in comparison.why


def test_a_higher_goodput_whose_bracket_overlaps_is_not_decided() -> None:
    # a passed 4 and was undecided above it (no decided miss: censored at 4); b passed 2 and missed 4 with
    # a decided fail. a's 4 >= b's ceiling 4: decided for a. Swap: b passed 4 too (censored) -> not decided.
    a = config("a", lambda rate: 0.5 if rate <= 4 else None, LADDER)
    assert a.mean_goodput == 4 and a.censored
    assert ranking.explain(a, config("b", edge(2), LADDER)).decided
    b = config("b", edge(4, ttft=0.3), LADDER.model_copy(update={"rate_cap": 4}))
    comparison = ranking.explain(a, b)
    assert not comparison.decided and "≥ 4 (censored)" in comparison.why


def test_repeats_widen_the_bracket_and_a_censored_repeat_leaves_the_config_censored() -> None:
    plan = LADDER
    first = searched("c", edge(8), plan, repeat=1)
    second = searched("c", edge(2), plan, repeat=2)
    summary = summarize_config([first, second])
    assert ranking.bracket(summary) == ranking.Bracket(2, 16)  # lowest goodput, highest first miss
    capped = searched("c", edge(100), plan.model_copy(update={"rate_cap": 8}), repeat=3)
    assert summarize_config([first, capped]).censored


def test_censored_goodput_is_named_a_lower_bound_in_words_and_in_summary_json() -> None:
    capped = config("capped", edge(100), LADDER.model_copy(update={"rate_cap": 4}))
    bracketed = config("bracketed", edge(8), LADDER)
    assert ranking.goodput_words(capped) == "≥ 4 req/s (censored: no rate above it was decided to miss)"
    assert ranking.goodput_words(bracketed) == "8 req/s"
    dumped = json.loads(capped.model_dump_json())
    assert dumped["censored"] is True and dumped["goodput_ceiling"] is None
    assert json.loads(bracketed.model_dump_json())["goodput_ceiling"] == 16
    # A config that passed nothing is not "at least 0".
    nothing = config("nothing", edge(0), LADDER.model_copy(update={"rate_cap": 1}))
    assert nothing.mean_goodput == 0 and not nothing.lower_bound_only


def test_a_config_that_held_no_rate_but_missed_one_is_decided_below_a_contender() -> None:
    plan = LoadSearch(start_rate=2, max_rate=4, growth=2, bisect_steps=0)
    # fast holds 4 and misses 8; none misses 2 and its rung below, 1, is undecided: it held nothing.
    fast, none = config("fast", edge(4), plan), config("none", lambda rate: None if rate < 2 else 5.0, plan)
    assert (none.mean_goodput, none.goodput_ceiling) == (0, 2)
    assert ranking.rank([none, fast]) == [fast]  # it cannot win
    [comparison] = ranking.comparisons(ranking.standing([none, fast]))
    assert (comparison.first, comparison.second, comparison.decided) == ("fast", "none", True)
    assert "none [0, 2)" in comparison.why
