"""How vLLM V1's scheduler turns arrivals into engine steps under a config's batching limits, simulated step
by step so a fitted step-time law can predict a config's TTFT and ITL without running it.

Read from vLLM 0.32.0 (`vllm/v1/core/sched/scheduler.py`, `vllm/config/scheduler.py`). Each step fills a
budget of `max_num_batched_tokens`: first the running requests in admission order (each takes what it still
has to compute: 1 token when decoding, the rest of its prefill capped by the budget left), then, only if no
request was preempted in this step, the waiting queue in FCFS order while fewer than `max_num_seqs` run.
Without chunked prefill a waiting request whose whole prefill does not fit the budget left stops admission
for this step, and those behind it wait too (vLLM's `break`, FCFS head-of-line); a waiting request whose
blocks do not fit stops admission the same way. A request whose prefill completes in a step emits its
first token at the step's end; each later step it is scheduled in emits one more.

KV: a request holds ceil((prompt + generated) / block_size) blocks. A running request that needs a block
more than the pool has free preempts the last request of the running list (the most recently admitted,
possibly itself), which frees its blocks, goes back to the front of the waiting queue and is recomputed
(prompt and the tokens generated so far prefilled again, minus its cached tokens); the step that finishes
the recompute emits its next token.

Simplifications (each one a place where the prediction can differ from an engine):
- An admitted request takes the blocks of its whole sequence at once; vLLM 0.32 checks that the whole input
  fits before admitting (`scheduler_reserve_full_isl`, on by default) but allocates chunk by chunk.
- Prefix-cached blocks count against the pool once per request that uses them (vLLM shares them); cached
  tokens are never computed, on the first prefill and on every recompute alike (the cache never evicts).
- Requests are refused at input when vLLM would refuse them: a sequence (prompt + output tokens) longer
  than the budget without chunked prefill (vLLM requires `max_model_len <= max_num_batched_tokens` then), or
  needing more blocks than the pool holds (vLLM requires the pool to hold one `max_model_len` sequence).
- The law is given the requests scheduled in a step, which are the running ones unless the budget ran out
  first (vLLM's running gauge counts those too).
- Steps run back to back with no scheduling, detokenising or network time beyond what the law charges; no
  speculative decoding, no async scheduling, no `long_prefill_token_threshold`, no KV watermark.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

DEFAULT_MAX_STEPS = 2_000_000

StepSeconds = Callable[[int, int], float]


def _check_count(owner: str, name: str, value: object, minimum: int) -> None:
    # bool is an int to Python, never a count to a caller.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}.{name}: {value!r} is not an integer; give a whole number >= {minimum}")
    if value < minimum:
        raise ValueError(f"{owner}.{name}: {value} is below {minimum}; give a whole number >= {minimum}")


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that hold TOKENS tokens."""
    return -(-tokens // block_size)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """A config's batching limits, as vLLM's scheduler applies them (the block size has no default here: the
    engine's depends on the device, and the profile owns that rule)."""

    max_num_batched_tokens: int  # token budget per step
    max_num_seqs: int
    chunked_prefill: bool = True
    pool_blocks: int | None = None  # None: KV never runs out
    block_size: int  # tokens per KV block

    def __post_init__(self) -> None:
        _check_count("limits", "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_count("limits", "max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM 0.32 refuses this config (`SchedulerConfig.verify_max_model_len`).
            raise ValueError(
                f"limits.max_num_batched_tokens: {self.max_num_batched_tokens} is below max_num_seqs "
                f"{self.max_num_seqs}, which vLLM refuses; give a budget of at least one token per sequence"
            )
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(f"limits.chunked_prefill: {self.chunked_prefill!r} is not true or false")
        if self.pool_blocks is not None:
            _check_count("limits", "pool_blocks", self.pool_blocks, 1)
        _check_count("limits", "block_size", self.block_size, 1)


@dataclass(frozen=True)
class Arrival:
    """One request as the engine receives it."""

    at_s: float  # arrival time
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache serves: never computed
    output_tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.at_s, bool) or not isinstance(self.at_s, int | float):
            raise ValueError(f"arrival.at_s: {self.at_s!r} is not a number of seconds")
        if not math.isfinite(self.at_s) or self.at_s < 0:
            raise ValueError(f"arrival.at_s: {self.at_s} is not a finite time >= 0 s")
        _check_count("arrival", "prompt_tokens", self.prompt_tokens, 1)
        _check_count("arrival", "cached_tokens", self.cached_tokens, 0)
        _check_count("arrival", "output_tokens", self.output_tokens, 1)
        if self.cached_tokens >= self.prompt_tokens:
            raise ValueError(
                f"arrival.cached_tokens: {self.cached_tokens} is not below prompt_tokens "
                f"{self.prompt_tokens}; the engine always computes a prompt's last token"
            )

    @property
    def prefill_tokens(self) -> int:
        """Tokens its first prefill computes."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class RequestResult:
    """What one request saw."""

    ttft_s: float | None  # None: never got its first token
    itl_s: tuple[float, ...]  # gaps between consecutive tokens
    finished: bool
    preemptions: int
    finished_s: float | None = None  # the end of the step that emitted its last token

    @property
    def tokens(self) -> int:
        """Output tokens emitted."""
        return (0 if self.ttft_s is None else 1) + len(self.itl_s)


@dataclass(frozen=True)
class SimResult:
    """One simulation: per request in the order given, and totals."""

    requests: tuple[RequestResult, ...]
    steps: int
    preemptions: int
    end_s: float  # the end of the last step (0 when there was none)
    truncated: bool  # stopped at max_steps with work left
    computed_tokens: int  # tokens computed over all steps, recomputes included

    def ttfts(self) -> list[float]:
        """Every first-token latency, of the requests that got one."""
        return [r.ttft_s for r in self.requests if r.ttft_s is not None]

    def itls(self) -> list[float]:
        """Every inter-token latency, all requests together."""
        return [gap for r in self.requests for gap in r.itl_s]


@dataclass(eq=False)
class _Request:
    """A request's state inside the simulation."""

    arrival: Arrival
    computed: int = 0  # tokens whose KV exists (cached ones included)
    generated: int = 0
    blocks: int = 0
    last_token_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    finished_s: float | None = None

    def __post_init__(self) -> None:
        self.computed = self.arrival.cached_tokens

    @property
    def length(self) -> int:
        """Tokens of its sequence so far: the prompt and what it generated."""
        return self.arrival.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens to compute before it emits its next token."""
        return self.length - self.computed

    def result(self) -> RequestResult:
        return RequestResult(
            ttft_s=self.ttft_s,
            itl_s=tuple(self.itl_s),
            finished=self.finished_s is not None,
            preemptions=self.preemptions,
            finished_s=self.finished_s,
        )


def _refusal(index: int, arrival: Arrival, limits: Limits) -> str | None:
    """Why vLLM would refuse this request under LIMITS, or None."""
    sequence = arrival.prompt_tokens + arrival.output_tokens
    if not limits.chunked_prefill and sequence > limits.max_num_batched_tokens:
        return (
            f"arrivals[{index}]: prompt_tokens + output_tokens = {sequence} exceeds max_num_batched_tokens "
            f"{limits.max_num_batched_tokens} without chunked prefill (vLLM then limits a sequence to the "
            "step budget and refuses longer ones); raise max_num_batched_tokens or enable chunked prefill"
        )
    if limits.pool_blocks is not None and blocks_for(sequence, limits.block_size) > limits.pool_blocks:
        return (
            f"arrivals[{index}]: prompt_tokens + output_tokens = {sequence} needs "
            f"{blocks_for(sequence, limits.block_size)} blocks of {limits.block_size} tokens, more than the "
            f"pool's {limits.pool_blocks} (vLLM refuses a sequence its KV pool cannot hold); "
            "give a larger pool or a shorter request"
        )
    return None


def _step_duration(step_seconds: StepSeconds, tokens: int, scheduled: int) -> float:
    seconds = step_seconds(tokens, scheduled)
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"step_seconds({tokens}, {scheduled}) returned {seconds!r}; a step takes a finite time > 0 s"
        )
    return float(seconds)


class _Engine:
    """The scheduler's queues and the KV pool between steps."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.free_blocks = limits.pool_blocks  # None: unlimited
        self.preemptions = 0

    def _grow(self, request: _Request) -> bool:
        """Give REQUEST the blocks its sequence needs, if the pool has them free."""
        need = blocks_for(request.length, self.limits.block_size) - request.blocks
        if self.free_blocks is not None:
            if need > self.free_blocks:
                return False
            self.free_blocks -= need
        request.blocks += need
        return True

    def release(self, request: _Request) -> None:
        if self.free_blocks is not None:
            self.free_blocks += request.blocks
        request.blocks = 0

    def _preempt_last(self) -> _Request:
        victim = self.running.pop()
        self.release(victim)
        victim.computed = victim.arrival.cached_tokens
        victim.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> list[tuple[_Request, int]]:
        """One step's batch: (request, tokens to compute) pairs, in vLLM's order."""
        budget = self.limits.max_num_batched_tokens
        batch: list[tuple[_Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            while not self._grow(request):
                preempted = True
                if self._preempt_last() is request:
                    break
            if request.blocks == 0:  # it preempted itself, the last of the list: the running pass is over
                break
            tokens = min(request.remaining, budget)
            batch.append((request, tokens))
            budget -= tokens
            index += 1
        if preempted:
            return batch
        while budget > 0 and self.waiting and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            if not self.limits.chunked_prefill and request.remaining > budget:
                break
            if not self._grow(request):
                break
            self.waiting.popleft()
            self.running.append(request)
            tokens = min(request.remaining, budget)
            batch.append((request, tokens))
            budget -= tokens
        return batch


def simulate(
    arrivals: Sequence[Arrival],
    limits: Limits,
    step_seconds: StepSeconds,
    max_steps: int = DEFAULT_MAX_STEPS,
) -> SimResult:
    """Run ARRIVALS through vLLM's scheduler under LIMITS, each step lasting step_seconds(tokens computed,
    requests scheduled); stop after MAX_STEPS steps (the result says it was truncated)."""
    _check_count("simulate", "max_steps", max_steps, 0)
    for index, arrival in enumerate(arrivals):
        if not isinstance(arrival, Arrival):
            raise ValueError(f"arrivals[{index}]: {arrival!r} is not an Arrival")
        problem = _refusal(index, arrival, limits)
        if problem is not None:
            raise ValueError(problem)
    requests = [_Request(arrival) for arrival in arrivals]
    # Ties keep the order given: FCFS among simultaneous arrivals.
    pending = deque(sorted(requests, key=lambda r: r.arrival.at_s))
    engine = _Engine(limits)
    now = end_s = 0.0
    steps = 0
    computed_tokens = 0
    while pending or engine.waiting or engine.running:
        if not engine.waiting and not engine.running and pending[0].arrival.at_s > now:
            now = pending[0].arrival.at_s
        while pending and pending[0].arrival.at_s <= now:
            engine.waiting.append(pending.popleft())
        if steps >= max_steps:
            break
        batch = engine.schedule()
        tokens = sum(count for _, count in batch)
        if tokens == 0:
            # Input checks make every queued request schedulable on an idle engine; reaching here is a bug.
            raise RuntimeError("scheduler made no progress with requests queued")
        now = end_s = now + _step_duration(step_seconds, tokens, len(batch))
        steps += 1
        computed_tokens += tokens
        for request, count in batch:
            request.computed += count
            if request.computed < request.length:
                continue  # a prefill chunk: no token yet
            if request.ttft_s is None:
                request.ttft_s = now - request.arrival.at_s
            else:
                request.itl_s.append(now - request.last_token_s)
            request.last_token_s = now
            request.generated += 1
            if request.generated == request.arrival.output_tokens:
                request.finished_s = now
                engine.release(request)
        engine.running = [r for r in engine.running if r.finished_s is None]
    return SimResult(
        requests=tuple(r.result() for r in requests),
        steps=steps,
        preemptions=engine.preemptions,
        end_s=end_s,
        truncated=bool(pending or engine.waiting or engine.running),
        computed_tokens=computed_tokens,
    )


def poisson_arrivals(
    rate: float, duration_s: float, seed: int, make: Callable[[int, float], Arrival]
) -> list[Arrival]:
    """Arrivals of a Poisson process of RATE per second over [0, DURATION_S): exponential gaps drawn from
    numpy's default_rng(SEED); make(index, at_s) gives each its sizes."""
    for name, value in (("rate", rate), ("duration_s", duration_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ValueError(f"poisson_arrivals.{name}: {value!r} is not a finite number")
    if rate <= 0:
        raise ValueError(f"poisson_arrivals.rate: {rate} is not > 0 requests per second")
    if duration_s < 0:
        raise ValueError(f"poisson_arrivals.duration_s: {duration_s} is not >= 0 s")
    rng = np.random.default_rng(seed)
    arrivals: list[Arrival] = []
    at_s = float(rng.exponential(1.0 / rate))
    while at_s < duration_s:
        arrivals.append(make(len(arrivals), at_s))
        at_s += float(rng.exponential(1.0 / rate))
    return arrivals
