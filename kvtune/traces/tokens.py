"""A hash-block trace as prompts an engine serves: each trace block becomes a fixed run of token ids.

vLLM's completions API takes a prompt as token ids, so a block of the trace maps to exactly
`tokens_per_block` tokens (a multiple of the engine's block size: one engine block by default, so the
engine's blocks are the trace's). Equal ids give equal tokens and different ids different ones, so the engine
sees the trace's sharing and nothing else. Lengths scale with the blocks: a trace block of 512 tokens
replayed as 32 engine tokens scales every length by 1/16, the output's too unless told otherwise.
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kvtune.traces.format import Trace, TraceError, TraceRequest

# Token ids drawn for a block: above every model's special tokens (ids below 1,000 in the models kvtune
# knows) and below the smallest vocabulary it serves (SmolLM2's 49,152).
TOKEN_LOW = 1000
TOKEN_HIGH = 30000


@dataclass(frozen=True)
class BlockMapping:
    """How a trace's blocks become engine tokens."""

    trace_block_size: int
    tokens_per_block: int
    engine_block_size: int
    max_model_len: int | None = None
    # Output tokens per trace output token; None: the prompt's scale (tokens_per_block / trace_block_size).
    output_scale: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.engine_block_size < 1 or self.tokens_per_block < 1:
            raise TraceError("tokens per block and the engine's block size must be positive")
        if self.tokens_per_block % self.engine_block_size:
            raise TraceError(
                f"tokens per trace block {self.tokens_per_block} is not a multiple of the engine's block "
                f"size {self.engine_block_size}; use {self.engine_block_size} or a multiple of it, so every "
                "engine block lies within one trace block"
            )
        if self.max_model_len is not None and self.max_model_len <= self.engine_block_size:
            raise TraceError(
                f"max_model_len {self.max_model_len} holds no more than one block of {self.engine_block_size}"
            )
        if self.output_scale is not None and not (math.isfinite(self.output_scale) and self.output_scale > 0):
            raise TraceError(f"output scale {self.output_scale} must be a positive number")

    @property
    def scale(self) -> float:
        return self.tokens_per_block / self.trace_block_size


@dataclass(frozen=True)
class EngineRequest:
    """One trace request as the engine serves it: its blocks, its sizes in engine tokens, what was cut."""

    index: int  # the request's position in the trace
    arrival_s: float  # intended send time, seconds from the first request (after any time scaling)
    hash_ids: tuple[int, ...]  # the trace blocks it keeps (the prompt's tail may be cut)
    prompt_tokens: int
    output_tokens: int
    cut_prompt_tokens: int = 0
    cut_output_tokens: int = 0

    def block_keys(self, mapping: BlockMapping) -> tuple[Hashable, ...]:
        """The engine's whole prompt blocks, each named by its trace block and its place in it: with chained
        trace ids, equal keys at equal positions mean equal prefixes, as vLLM's block hashes do."""
        per = mapping.tokens_per_block // mapping.engine_block_size
        full = self.prompt_tokens // mapping.engine_block_size
        return tuple((self.hash_ids[block // per], block % per) for block in range(full))

    @property
    def kv_tokens(self) -> int:
        """Tokens whose KV the request computes: the prompt and every output token but the last."""
        return max(1, self.prompt_tokens + self.output_tokens - 1)

    def total_blocks(self, engine_block_size: int) -> int:
        """Engine blocks the request holds at its end."""
        return -(-self.kv_tokens // engine_block_size)

    def cached_blocks(self, engine_block_size: int) -> int:
        """Of those, the full ones: vLLM hashes and caches them when the request ends."""
        return self.kv_tokens // engine_block_size


@dataclass(frozen=True)
class Cuts:
    """What fitting the trace within max_model_len cut."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


def engine_request(
    request: TraceRequest, index: int, arrival_s: float, mapping: BlockMapping
) -> EngineRequest:
    """REQUEST scaled to engine tokens and kept within max_model_len (the output first keeps room for at least
    one block of prompt, then the prompt's tail is cut)."""
    tpb = mapping.tokens_per_block
    full, rest = divmod(request.input_length, mapping.trace_block_size)
    prompt = full * tpb + (math.ceil(rest * mapping.scale) if rest else 0)
    prompt = max(prompt, 1)
    output_scale = mapping.scale if mapping.output_scale is None else mapping.output_scale
    output = max(1, math.ceil(request.output_length * output_scale))
    cut_prompt = cut_output = 0
    if mapping.max_model_len is not None:
        room = mapping.max_model_len - mapping.engine_block_size
        if output > room:
            cut_output, output = output - room, room
        if prompt + output > mapping.max_model_len:
            kept = mapping.max_model_len - output
            cut_prompt, prompt = prompt - kept, kept
    ids = request.hash_ids[: -(-prompt // tpb)]
    return EngineRequest(index, arrival_s, ids, prompt, output, cut_prompt, cut_output)


def engine_requests(
    trace: Trace, mapping: BlockMapping, selected: Sequence[tuple[int, float]] | None = None
) -> tuple[list[EngineRequest], Cuts]:
    """The trace's requests (or the SELECTED ones: (index, arrival seconds)) as the engine serves them, and
    what fitting them within max_model_len cut."""
    if mapping.trace_block_size != trace.block_size:
        raise TraceError(
            f"the mapping's trace block size {mapping.trace_block_size} is not the trace's {trace.block_size}"
        )
    if selected is None:
        first = trace.requests[0].timestamp_ms if trace.requests else 0.0
        selected = [(i, (r.timestamp_ms - first) / 1000) for i, r in enumerate(trace.requests)]
    out = [engine_request(trace.requests[i], i, at, mapping) for i, at in selected]
    cut = [r for r in out if r.cut_prompt_tokens or r.cut_output_tokens]
    return out, Cuts(len(cut), sum(r.cut_prompt_tokens for r in cut), sum(r.cut_output_tokens for r in cut))


@functools.lru_cache(maxsize=65536)
def _block_tokens(seed: int, hash_id: int, count: int, high: int) -> tuple[int, ...]:
    # random.Random seeded with text is the same in every process and Python release (seed version 2).
    rng = random.Random(f"kvtune-trace:{seed}:{hash_id}")
    return tuple(rng.randrange(TOKEN_LOW, high) for _ in range(count))


def prompt_token_ids(
    request: EngineRequest, mapping: BlockMapping, vocab_size: int | None = None
) -> list[int]:
    """The request's prompt as token ids: each trace block's run (its first tokens for a partial block)."""
    high = min(TOKEN_HIGH, vocab_size) if vocab_size else TOKEN_HIGH
    if high <= TOKEN_LOW:
        raise TraceError(f"a vocabulary of {vocab_size} tokens is too small to replay a trace's blocks")
    ids: list[int] = []
    for hash_id in request.hash_ids:
        ids.extend(_block_tokens(mapping.seed, hash_id, mapping.tokens_per_block, high))
    return ids[: request.prompt_tokens]
