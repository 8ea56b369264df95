"""The scheduler simulation against cases computed by hand, and properties over generated workloads."""

from __future__ import annotations

import math

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvtune.perfmodel.scheduler import (
    Arrival,
    Limits,
    SimResult,
    blocks_for,
    poisson_arrivals,
    simulate,
)


def law(tokens: int, running: int) -> float:
    """The hand cases' step law: 10 ms a step plus 1 ms a token."""
    return 0.01 + 0.001 * tokens


def arrival(prompt: int, output: int, cached: int = 0, at_s: float = 0.0) -> Arrival:
    return Arrival(at_s=at_s, prompt_tokens=prompt, cached_tokens=cached, output_tokens=output)


def approx(values: list[float] | tuple[float, ...]) -> object:
    return pytest.approx(list(values), abs=1e-12)


def test_one_request_prefills_in_one_step_then_decodes() -> None:
    result = simulate(
        [arrival(100, 5)], Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16), law
    )
    (request,) = result.requests
    # prefill: 0.01 + 0.001 * 100 = 0.11 s; each decode: 0.01 + 0.001 * 1 = 0.011 s
    assert request.ttft_s == pytest.approx(0.11)
    assert request.itl_s == approx([0.011] * 4)
    assert request.finished and request.preemptions == 0
    assert request.finished_s == pytest.approx(0.11 + 4 * 0.011)
    assert (result.steps, result.computed_tokens, result.preemptions) == (5, 104, 0)
    assert result.end_s == pytest.approx(0.154)
    assert not result.truncated
    assert result.ttfts() == [request.ttft_s]
    assert result.itls() == list(request.itl_s)


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    result = simulate(
        [arrival(1000, 2)], Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16), law
    )
    (request,) = result.requests
    # 512 tokens (0.522 s) then 488 (0.498 s): the first token at 1.02 s
    assert request.ttft_s == pytest.approx(0.522 + 0.498)
    assert request.itl_s == approx([0.011])
    assert result.steps == 3


def test_without_chunked_prefill_a_sequence_longer_than_the_budget_is_refused() -> None:
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4, chunked_prefill=False, block_size=16)
    with pytest.raises(ValueError, match=r"arrivals\[1\].*exceeds max_num_batched_tokens 512"):
        simulate([arrival(100, 1), arrival(600, 1)], limits, law)
    # vLLM's limit is the whole sequence (max_model_len <= budget): 500 + 13 tokens does not fit either
    with pytest.raises(ValueError, match="513 exceeds"):
        simulate([arrival(500, 13)], limits, law)
    # chunked prefill takes it
    assert (
        simulate(
            [arrival(600, 1)], Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16), law
        ).steps
        == 2
    )


def test_without_chunked_prefill_a_prompt_that_does_not_fit_blocks_the_ones_behind_it() -> None:
    # vLLM 0.32 stops admitting (`break`) at the first waiting request whose prefill exceeds the budget
    # left, so a smaller request behind it waits although it would fit.
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=8, chunked_prefill=False, block_size=16)
    a, b, c = arrival(400, 3), arrival(300, 1), arrival(50, 1)
    result = simulate([a, b, c], limits, law)
    ra, rb, rc = result.requests
    # step 1: A's 400 tokens; 112 left, B's 300 do not fit, C waits behind B: 0.41 s
    assert ra.ttft_s == pytest.approx(0.41)
    # step 2: A decodes 1, B 300, C 50 = 351 tokens: 0.361 s, ends at 0.771
    assert rb.ttft_s == pytest.approx(0.771)
    assert rc.ttft_s == pytest.approx(0.771)
    # step 3: A decodes alone: 0.011 s
    assert ra.itl_s == approx([0.361, 0.011])
    # with chunked prefill, step 1 is A 400 + B 112 (budget spent), C still waits: only B is sped up
    chunked = simulate([a, b, c], Limits(max_num_batched_tokens=512, max_num_seqs=8, block_size=16), law)
    # step 1: 512 tokens, 0.522 s; step 2: A 1 + B 188 + C 50 = 239 tokens, 0.249 s
    assert [r.ttft_s for r in chunked.requests] == approx([0.522, 0.771, 0.771])


def test_a_full_batch_makes_the_next_request_wait_for_a_seat() -> None:
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=2, block_size=16)
    result = simulate([arrival(100, 3), arrival(100, 3), arrival(100, 3)], limits, law)
    first, second, third = result.requests
    # step 1: A and B prefill 200 tokens: 0.21 s; C finds both seats taken
    assert first.ttft_s == pytest.approx(0.21)
    assert second.ttft_s == pytest.approx(0.21)
    # steps 2 and 3: A and B decode 2 tokens each step: 0.012 s; both finish at 0.234
    assert first.itl_s == approx([0.012, 0.012])
    assert first.finished_s == pytest.approx(0.234)
    # step 4: C prefills 100 tokens: 0.11 s, its first token at 0.234 + 0.11 = 0.344 (0.234 s of it waiting)
    assert third.ttft_s == pytest.approx(0.344)
    assert third.itl_s == approx([0.011, 0.011])
    assert result.end_s == pytest.approx(0.366)


def test_cached_prompt_tokens_are_not_computed() -> None:
    result = simulate(
        [arrival(500, 2, cached=400)], Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16), law
    )
    # 100 tokens computed: 0.11 s, then one decode
    assert result.requests[0].ttft_s == pytest.approx(0.11)
    assert result.computed_tokens == 101


def test_a_request_needing_a_block_preempts_the_last_admitted_one_which_is_recomputed() -> None:
    # Blocks of 4 tokens, a pool of 3. A: 7 prompt tokens, 3 out; B: 2 prompt tokens (1 cached), 4 out.
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4, pool_blocks=3, block_size=4)
    result = simulate([arrival(7, 3), arrival(2, 4, cached=1)], limits, law)
    a, b = result.requests
    # step 1: A 7 tokens (2 blocks), B 1 token (1 block), pool full: 8 tokens, 0.018 s
    # step 2: A (8 tokens long) and B (3) decode: 0.012 s, ends at 0.030
    # step 3: A is 9 tokens long, needs a 3rd block: B, the last admitted, is preempted (frees 1 block, goes
    #   back to waiting with its 4 tokens, 1 cached); no admission in a step that preempted; A decodes
    #   alone: 0.011 s, ends at 0.041; A is done and frees its 3 blocks
    # step 4: B readmitted, recomputes its uncached prompt token + 2 generated: 0.013 s, ends at 0.054: its
    #   token gap is 0.054 - 0.030 = 0.024
    # step 5: B (5 tokens long) takes a 2nd block and decodes its last token: 0.011 s, ends at 0.065
    assert a.ttft_s == pytest.approx(0.018)
    assert a.itl_s == approx([0.012, 0.011])
    assert a.preemptions == 0
    assert b.ttft_s == pytest.approx(0.018)
    assert b.itl_s == approx([0.012, 0.024, 0.011])
    assert b.preemptions == 1
    assert a.finished and b.finished
    assert (result.preemptions, result.steps, result.computed_tokens) == (1, 5, 15)
    assert result.end_s == pytest.approx(0.065)


def test_the_last_admitted_request_needing_a_block_preempts_itself() -> None:
    # Blocks of 4, a pool of 5. A and B: 4 prompt tokens, 6 out; each grows to 3 blocks, together 6.
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4, pool_blocks=5, block_size=4)
    result = simulate([arrival(4, 6), arrival(4, 6)], limits, law)
    a, b = result.requests
    # step 1: both prefill, 8 tokens: 0.018 s; steps 2-5: both decode, 0.012 s each, ending at 0.066, and
    #   each holds 2 blocks (1 free)
    # step 6: A (9 tokens long) takes the free block; B needs one too, and is itself the last admitted: it is
    #   preempted; A decodes alone (0.011 s, ends at 0.077) and finishes
    # step 7: B recomputes its 9 tokens: 0.019 s, ends at 0.096, a gap of 0.096 - 0.066 = 0.030
    assert a.itl_s == approx([0.012] * 4 + [0.011])
    assert b.itl_s == approx([0.012] * 4 + [0.030])
    assert (a.preemptions, b.preemptions, result.preemptions) == (0, 1, 1)
    assert (result.steps, result.computed_tokens) == (7, 26)
    assert result.end_s == pytest.approx(0.096)


def test_a_preempted_request_goes_back_ahead_of_the_waiting_ones() -> None:
    # As the preemption case, plus C (9 prompt tokens: 3 blocks, 1 out) arriving during step 2, waiting for
    # blocks. B preempted at step 3 goes ahead of C: at step 4 B is admitted first (1 block of the 3 free)
    # and C, needing 3, waits behind it.
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4, pool_blocks=3, block_size=4)
    result = simulate([arrival(7, 3), arrival(2, 4, cached=1), arrival(9, 1, at_s=0.025)], limits, law)
    b, c = result.requests[1], result.requests[2]
    # step 4: B recomputes 3 tokens: 0.013 s, ends at 0.054; step 5: B's last decode (C still does not
    # fit), ends at 0.065 and frees B's block; step 6: C prefills 9 tokens, 0.019 s, ends at 0.084
    assert b.itl_s == approx([0.012, 0.024, 0.011])
    assert c.ttft_s == pytest.approx(0.084 - 0.025)
    assert result.preemptions == 1


def test_idle_time_jumps_to_the_next_arrival() -> None:
    result = simulate(
        [arrival(100, 1, at_s=5.0), arrival(100, 1, at_s=1.0)],
        Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16),
        law,
    )
    assert [r.ttft_s for r in result.requests] == approx([0.11, 0.11])
    assert [r.finished_s for r in result.requests] == approx([5.11, 1.11])
    assert result.end_s == pytest.approx(5.11)


def test_max_steps_truncates_and_says_so() -> None:
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16)
    result = simulate([arrival(100, 5)], limits, law, max_steps=2)
    assert result.truncated and result.steps == 2
    assert not result.requests[0].finished
    assert result.requests[0].tokens == 2
    assert result.end_s == pytest.approx(0.121)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_a_step_law_that_does_not_move_time_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"step_seconds\(100, 1\) returned"):
        simulate(
            [arrival(100, 2)],
            Limits(max_num_batched_tokens=512, max_num_seqs=4, block_size=16),
            lambda n, r: bad,
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_num_batched_tokens": 0}, "limits.max_num_batched_tokens: 0 is below 1"),
        ({"max_num_seqs": True}, "limits.max_num_seqs: True is not an integer"),
        ({"max_num_seqs": 513}, "limits.max_num_batched_tokens: 512 is below max_num_seqs 513"),
        ({"pool_blocks": 0}, "limits.pool_blocks: 0 is below 1"),
        ({"block_size": 2.0}, "limits.block_size: 2.0 is not an integer"),
        ({"chunked_prefill": "yes"}, "limits.chunked_prefill: 'yes' is not true or false"),
    ],
)
def test_bad_limits_name_the_field(fields: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"max_num_batched_tokens": 512, "max_num_seqs": 4, "block_size": 16} | fields
    with pytest.raises(ValueError, match=message):
        Limits(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"at_s": -1.0}, "arrival.at_s: -1.0 is not a finite time"),
        ({"at_s": math.nan}, "arrival.at_s: nan is not a finite time"),
        ({"prompt_tokens": 0}, "arrival.prompt_tokens: 0 is below 1"),
        ({"cached_tokens": 10}, "arrival.cached_tokens: 10 is not below prompt_tokens 10"),
        ({"cached_tokens": -1}, "arrival.cached_tokens: -1 is below 0"),
        ({"output_tokens": 0}, "arrival.output_tokens: 0 is below 1"),
    ],
)
def test_bad_arrivals_name_the_field(fields: dict[str, object], message: str) -> None:
    values: dict[str, object] = {"at_s": 0.0, "prompt_tokens": 10, "cached_tokens": 0, "output_tokens": 1}
    with pytest.raises(ValueError, match=message):
        Arrival(**(values | fields))  # type: ignore[arg-type]


def test_a_request_the_pool_cannot_hold_is_refused() -> None:
    limits = Limits(max_num_batched_tokens=512, max_num_seqs=4, pool_blocks=2, block_size=4)
    with pytest.raises(
        ValueError, match=r"arrivals\[0\].*needs 3 blocks of 4 tokens, more than the pool's 2"
    ):
        simulate([arrival(8, 1)], limits, law)


def test_poisson_arrivals_are_seeded_ordered_and_within_the_window() -> None:
    def make(index: int, at_s: float) -> Arrival:
        return arrival(10 + index, 2, at_s=at_s)

    first = poisson_arrivals(100.0, 10.0, seed=7, make=make)
    assert first == poisson_arrivals(100.0, 10.0, seed=7, make=make)
    assert first != poisson_arrivals(100.0, 10.0, seed=8, make=make)
    times = [a.at_s for a in first]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 10.0
    # 1,000 expected; the Poisson count's standard deviation is ~32
    assert 850 < len(first) < 1150
    assert [a.prompt_tokens for a in first[:3]] == [10, 11, 12]
    assert poisson_arrivals(5.0, 0.0, seed=1, make=make) == []
    with pytest.raises(ValueError, match=r"poisson_arrivals\.rate"):
        poisson_arrivals(0.0, 1.0, seed=1, make=make)
    with pytest.raises(ValueError, match=r"poisson_arrivals\.duration_s"):
        poisson_arrivals(1.0, math.inf, seed=1, make=make)


# Workloads small enough for hundreds of examples in a few seconds.
@st.composite
def workloads(draw: st.DrawFn) -> tuple[list[Arrival], Limits, tuple[float, float, float]]:
    arrivals = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.integers(1, 40))
        arrivals.append(
            Arrival(
                at_s=draw(st.floats(0.0, 0.1, allow_nan=False)),
                prompt_tokens=prompt,
                cached_tokens=draw(st.integers(0, prompt - 1)),
                output_tokens=draw(st.integers(1, 20)),
            )
        )
    chunked = draw(st.booleans())
    longest = max(a.prompt_tokens + a.output_tokens for a in arrivals)
    seqs = draw(st.integers(1, 4))
    budget = draw(st.integers(seqs, 64)) if chunked else max(longest, seqs) + draw(st.integers(0, 20))
    block_size = draw(st.integers(1, 6))
    # The pool holds the largest request alone (plus a little: tight enough to preempt often), or, in a
    # quarter of the cases, never runs out.
    largest = max(blocks_for(a.prompt_tokens + a.output_tokens, block_size) for a in arrivals)
    pool = None if draw(st.integers(0, 3)) == 0 else draw(st.integers(largest, largest + 3))
    limits = Limits(
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        chunked_prefill=chunked,
        pool_blocks=pool,
        block_size=block_size,
    )
    coefficients = (
        draw(st.floats(1e-3, 1e-1)),
        draw(st.floats(1e-5, 1e-2)),
        draw(st.floats(0.0, 1e-2)),
    )
    return arrivals, limits, coefficients


def _run(workload: tuple[list[Arrival], Limits, tuple[float, float, float]]) -> SimResult:
    arrivals, limits, (fixed, per_token, per_request) = workload
    return simulate(arrivals, limits, lambda n, r: fixed + per_token * n + per_request * r)


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_every_request_finishes_with_its_tokens_when_the_pool_holds_the_largest(
    workload: tuple[list[Arrival], Limits, tuple[float, float, float]],
) -> None:
    arrivals, limits, (fixed, per_token, per_request) = workload
    result = _run(workload)
    event(f"preempted: {result.preemptions > 0}, chunked prefill: {limits.chunked_prefill}")
    assert not result.truncated
    assert result == _run(workload)  # deterministic
    for given_arrival, request in zip(arrivals, result.requests, strict=True):
        assert request.finished
        assert request.tokens == given_arrival.output_tokens
        assert request.ttft_s is not None and request.finished_s is not None
        # Its own prefill alone: at least one step per budget-full chunk, each charging its tokens.
        prefill = given_arrival.prefill_tokens
        chunks = math.ceil(prefill / limits.max_num_batched_tokens)
        own = chunks * (fixed + per_request) + per_token * prefill
        assert request.ttft_s >= own - 1e-9
        # Every token gap spans at least one step of one request computing one token.
        assert all(gap >= fixed + per_token + per_request - 1e-12 for gap in request.itl_s)
        assert request.finished_s - given_arrival.at_s == pytest.approx(
            request.ttft_s + sum(request.itl_s), abs=1e-9
        )
    least = sum(a.prefill_tokens + a.output_tokens - 1 for a in arrivals)
    assert result.computed_tokens >= least
    if result.preemptions == 0:
        assert result.computed_tokens == least
    assert result.preemptions == sum(r.preemptions for r in result.requests)
    if limits.pool_blocks is None:
        assert result.preemptions == 0


def test_a_tight_pool_under_poisson_load_preempts_and_still_finishes_everything() -> None:
    def make(index: int, at_s: float) -> Arrival:
        return arrival(20 + index % 30, 5 + index % 20, cached=index % 7, at_s=at_s)

    arrivals = poisson_arrivals(50.0, 4.0, seed=3, make=make)
    limits = Limits(max_num_batched_tokens=64, max_num_seqs=16, pool_blocks=12, block_size=8)
    result = simulate(arrivals, limits, law)
    assert result.preemptions > 0
    assert all(
        r.finished and r.tokens == a.output_tokens for r, a in zip(result.requests, arrivals, strict=True)
    )
    assert result.computed_tokens > sum(a.prefill_tokens + a.output_tokens - 1 for a in arrivals)
    # the same load with a pool that never runs out: no preemption, and no request slower to its first token
    roomy = simulate(arrivals, Limits(max_num_batched_tokens=64, max_num_seqs=16, block_size=16), law)
    assert roomy.preemptions == 0
    assert sum(roomy.ttfts()) < sum(result.ttfts())
