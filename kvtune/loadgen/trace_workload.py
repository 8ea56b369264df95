"""The trace workload: a recorded trace's requests, in its order, at its own arrival times.

A trace file is one of two kinds, told apart by its first line:
- hash-block lines (kvtune.traces.format): sizes and chained block ids, no text. Each request becomes a
  completion prompt of token ids (kvtune.traces.tokens), so the engine sees the trace's sharing and nothing
  else, sent with `ignore_eos` so every answer has the trace's output length. Lengths are kept within the
  engine's max_model_len, and what that cut is reported.
- kvtune's replay lines ({"messages": [...]} or {"prompt": "..."}, optional "max_tokens") with an optional
  "timestamp" in milliseconds (on every line or on none).

The same flags pick what is replayed from either kind (a start, a count, a span, a share of whole
conversations, a time scale: kvtune.traces.window), and a run ends when those requests are answered: a trace
is never cycled, which would change what it reuses. Nothing here imports Locust: the runner reads the plan
before Locust starts (a bad trace is refused before any load), the Locust file builds the requests.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtune.loadgen.pacing import Arrival
from kvtune.loadgen.workload_args import WorkloadError, workload_sizes
from kvtune.loadgen.workloads import Conversation, LLMRequest, replay_record
from kvtune.traces.curve import hittable_blocks
from kvtune.traces.format import (
    MAX_REQUESTS,
    MAX_TIMESTAMP_MS,
    Trace,
    TraceError,
    TraceRequest,
    is_block_trace,
    numbered_lines,
    parse_line,
    read_trace,
)
from kvtune.traces.tokens import BlockMapping, Cuts, EngineRequest, engine_requests, prompt_token_ids
from kvtune.traces.window import TraceWindow, select

# The flags that say how a hash-block trace's blocks become engine tokens: a text trace has no blocks.
BLOCK_FLAGS = ("trace-block-size", "tokens-per-block", "output-scale")
_KIND = "a trace (JSONL of requests)"


@dataclass(frozen=True)
class TraceArgs:
    """The trace workload's flags, typed (declared in kvtune.loadgen.workload_args)."""

    path: Path
    block_size: int | None = None
    tokens_per_block: int | None = None
    output_scale: float | None = None
    window: TraceWindow = field(default_factory=TraceWindow)
    given: frozenset[str] = frozenset()  # the flags set, defaults aside

    @classmethod
    def of(cls, args: Mapping[str, str | int | float], seed: int = 0) -> TraceArgs:
        """ARGS (flag -> value) checked as their declarations say; WorkloadError naming a bad one."""
        values = workload_sizes("trace", args).values

        def number(flag: str) -> float | None:
            value = values[flag]
            return None if value is None else float(value)

        def count(flag: str) -> int | None:
            value = values[flag]
            return None if value is None else int(value)

        try:
            window = TraceWindow(
                start=count("trace-start") or 0,
                count=count("trace-count"),
                duration_s=number("trace-duration"),
                sample=number("trace-sample") or 1.0,
                time_scale=number("time-scale") or 1.0,
                seed=seed,
            )
        except TraceError as exc:  # the flags' own bounds come first: this is a backstop
            raise WorkloadError(str(exc)) from None
        return cls(
            path=Path(str(values["trace-file"])),
            block_size=count("trace-block-size"),
            tokens_per_block=count("tokens-per-block"),
            output_scale=number("output-scale"),
            window=window,
            given=frozenset(flag.removeprefix("--") for flag in args),
        )


@dataclass(frozen=True)
class TraceFile:
    """A trace as read. A text trace's messages stand in for blocks (one a block, chained ids), so whole
    conversations are found and sampled as in a hash-block trace; `texts` holds its requests."""

    trace: Trace
    texts: tuple[LLMRequest, ...] | None = None  # None: a hash-block trace
    timed: bool = True  # its lines carry timestamps


@dataclass(frozen=True)
class EngineFacts:
    """What the engine says of itself that a hash-block trace is fitted to; None where it says nothing."""

    block_size: int | None = None  # vllm:cache_config_info's block_size on /metrics
    max_model_len: int | None = None  # GET /v1/models
    vocab_size: int | None = None  # the served model's tokenizer's


@dataclass
class TraceWorkload:
    """The selected requests in trace order: request i is due `arrivals[i]` seconds after the run's start."""

    source: str
    arrivals: list[float]
    request_at: Callable[[int], LLMRequest]
    cuts: Cuts = field(default_factory=Cuts)
    target_reuse: float | None = None
    name: str = "trace"

    def __len__(self) -> int:
        return len(self.arrivals)

    def next_request(self, index: int, conversation: Conversation) -> LLMRequest:
        return self.request_at(index)

    def describe(self) -> dict[str, Any]:
        return {
            "path": self.source,
            "requests": len(self),
            "span_s": round(self.arrivals[-1], 3) if self.arrivals else 0.0,
            "cut_requests": self.cuts.requests,
            "target_reuse": self.target_reuse,
        }


def read_trace_file(args: TraceArgs, default_max_tokens: int) -> TraceFile:
    """The trace in ARGS.path, whichever its kind; WorkloadError naming the line, the field and the fix."""
    try:
        first = next(iter(numbered_lines(args.path, _KIND)), None)
        if first is None:
            raise WorkloadError(f"{args.path}: holds no requests; a trace is JSON lines, one request a line")
        if is_block_trace(parse_line(first[1], f"{args.path}:{first[0]}")):
            return TraceFile(read_trace(args.path, args.block_size))
        for flag in BLOCK_FLAGS:
            if flag in args.given:
                raise WorkloadError(
                    f"{flag}: {args.path} is a text trace (prompts or messages, no hash_ids); {flag} applies "
                    "to hash-block traces only"
                )
        return _read_text_trace(args.path, default_max_tokens)
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None


def _read_text_trace(path: Path, default_max_tokens: int) -> TraceFile:
    requests: list[TraceRequest] = []
    texts: list[LLMRequest] = []
    ids: dict[tuple[int, str], int] = {}
    first_line: tuple[int, bool] | None = None  # its number, and whether it has a timestamp
    previous = 0.0
    for number, raw in numbered_lines(path, _KIND):
        where = f"{path}:{number}"
        item = parse_line(raw, where)
        text = replay_record(item, where, default_max_tokens)
        stamped = "timestamp" in item
        if first_line is None:
            first_line = (number, stamped)
        elif stamped != first_line[1]:
            has = "has a timestamp" if stamped else "has no timestamp"
            raise WorkloadError(
                f"{where}: {has}, unlike line {first_line[0]}; give every line a timestamp (ms) or none"
            )
        at = _timestamp(item["timestamp"], where, previous) if stamped else 0.0
        previous = at
        parts = [json.dumps(text.prompt)] if text.messages is None else [
            json.dumps(message, sort_keys=True) for message in text.messages
        ]  # fmt: skip
        chain: list[int] = []
        parent = -1
        for part in parts:
            parent = ids.setdefault((parent, part), len(ids))
            chain.append(parent)
        if len(requests) >= MAX_REQUESTS:
            raise WorkloadError(f"{where}: the trace holds more than {MAX_REQUESTS:,} requests; use a part")
        requests.append(TraceRequest(at, len(parts), 0, tuple(chain)))
        texts.append(replace(text, trace_index=len(texts)))
    if first_line is None:
        raise WorkloadError(f"{path}: holds no requests; a trace is JSON lines, one request a line")
    return TraceFile(Trace(1, tuple(requests), str(path)), tuple(texts), timed=first_line[1])


def _timestamp(value: Any, where: str, previous: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkloadError(f"{where}: timestamp is not a number of milliseconds")
    if not 0 <= value <= MAX_TIMESTAMP_MS:
        raise WorkloadError(f"{where}: timestamp {value:g} ms is outside 0..{MAX_TIMESTAMP_MS:g}; fix it")
    if value < previous:
        raise WorkloadError(
            f"{where}: timestamp {value:g} ms is before the previous line's {previous:g} ms; a trace lists "
            "requests in arrival order (sort it by timestamp)"
        )
    return float(value)


def check_pacing(file: TraceFile, arrival: Arrival) -> None:
    """A trace's own times need a trace that has them."""
    if arrival == "trace" and not file.timed:
        raise WorkloadError(
            f"{file.trace.source}: no line has a timestamp, so there are no arrival times to keep; add "
            '"timestamp" (ms) to every line, or replay it with --arrival closed (or poisson --rate R)'
        )


def selected(file: TraceFile, window: TraceWindow) -> list[tuple[int, float]]:
    """(trace index, intended seconds after the run's start) of each request the window keeps."""
    try:
        return select(file.trace, window)
    except TraceError as exc:  # the only one: a start past the trace's end
        raise WorkloadError(f"trace-start: {exc}") from None


def trace_arrivals(args: TraceArgs, arrival: Arrival, default_max_tokens: int) -> list[float]:
    """When each request of the run is due (seconds after its start): what the runner counts unsent by."""
    file = read_trace_file(args, default_max_tokens)
    check_pacing(file, arrival)
    return [at for _index, at in selected(file, args.window)]


def build_trace_workload(
    args: TraceArgs, engine: EngineFacts, arrival: Arrival, default_max_tokens: int, seed: int = 0
) -> TraceWorkload:
    """The run's requests, fitted to ENGINE; WorkloadError naming the flag or line for anything unusable."""
    file = read_trace_file(args, default_max_tokens)
    check_pacing(file, arrival)
    chosen = selected(file, args.window)
    arrivals = [at for _index, at in chosen]
    if file.texts is not None:
        texts = [file.texts[index] for index, _at in chosen]
        return TraceWorkload(file.trace.source, arrivals, texts.__getitem__)
    mapping = _mapping(file.trace, args, engine, seed)
    blocks, cuts = engine_requests(file.trace, mapping, chosen)
    shared = reusable_tokens(blocks, mapping)

    def request_at(position: int) -> LLMRequest:
        block = blocks[position]
        return LLMRequest(
            max_tokens=block.output_tokens,
            prompt_tokens=block.prompt_tokens,
            shared_tokens=shared[position],
            prompt_token_ids=prompt_token_ids(block, mapping, engine.vocab_size),
            ignore_eos=True,
            trace_index=block.index,
            cut_prompt_tokens=block.cut_prompt_tokens,
            cut_output_tokens=block.cut_output_tokens,
        )

    try:
        request_at(0)  # a vocabulary too small for the trace's token ids is refused now, not per request
    except TraceError as exc:
        raise WorkloadError(str(exc)) from None
    prompt = sum(block.prompt_tokens for block in blocks)
    target = sum(shared) / prompt if prompt else None
    return TraceWorkload(file.trace.source, arrivals, request_at, cuts, target)


def _mapping(trace: Trace, args: TraceArgs, engine: EngineFacts, seed: int) -> BlockMapping:
    tokens_per_block = args.tokens_per_block or engine.block_size
    if tokens_per_block is None:
        raise WorkloadError(
            "tokens-per-block: the engine reports no block size (vllm:cache_config_info on its /metrics); "
            "give the engine tokens per trace block, e.g. tokens-per-block=128 (an engine's --block-size)"
        )
    try:
        return BlockMapping(
            trace.block_size,
            tokens_per_block,
            engine.block_size or tokens_per_block,
            engine.max_model_len,
            args.output_scale,
            seed,
        )
    except TraceError as exc:
        raise WorkloadError(f"tokens-per-block: {exc}") from None


def reusable_tokens(requests: Sequence[EngineRequest], mapping: BlockMapping) -> list[int]:
    """Prompt tokens of each request that a prefix cache of unbounded size could serve, the requests taken one
    at a time in order: its whole blocks seen in earlier prompts (chained keys: a block is reusable only after
    every block before it), never the prompt's last token (kvtune.traces.curve.hittable_blocks)."""
    seen: set[object] = set()
    reusable = []
    block_size = mapping.engine_block_size
    for request in requests:
        keys = request.block_keys(mapping)
        hits = next((i for i, key in enumerate(keys) if key not in seen), len(keys))
        reusable.append(hittable_blocks(request.prompt_tokens, hits, block_size) * block_size)
        seen.update(keys)
    return reusable
