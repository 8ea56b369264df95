"""A multi-turn chat trace made to order: conversations sharing a few system prompts, each turn resending
the conversation so far, arriving with gaps long enough that pools of different sizes keep different parts.

It is what a test or a benchmark replays when a user's own trace is not at hand: its sharing is known by
construction (the system prompts, each conversation's history), so a hit-rate curve can be checked against
an engine on it. Ids are chained like Mooncake's: an id is given to a block's content after its parent id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtune.traces.format import TraceRequest

Label = tuple[str, int, int]


@dataclass(frozen=True)
class ChatTraceShape:
    """The traffic to make. Sizes are in the trace's tokens."""

    conversations: int = 200
    system_prompts: int = 4
    system_tokens: int = 256
    turns: int = 4  # each conversation has 1..turns turns, evenly
    user_tokens: int = 64
    output_tokens: int = 32
    block_size: int = 32
    conversation_rate: float = 1.0  # new conversations per second (Poisson)
    think_s: float = 20.0  # mean gap between a conversation's turns (exponential)
    seed: int = 0


def chat_trace(shape: ChatTraceShape) -> list[TraceRequest]:
    """The requests of SHAPE in arrival order."""
    rng = random.Random(shape.seed)
    ids: dict[tuple[int, tuple[Label, ...]], int] = {}
    turns_at: list[tuple[float, int, int]] = []  # (time, conversation, turn)
    start = 0.0
    for conversation in range(shape.conversations):
        start += rng.expovariate(shape.conversation_rate)
        at = start
        for turn in range(rng.randint(1, shape.turns)):
            turns_at.append((at, conversation, turn))
            at += rng.expovariate(1 / shape.think_s)
    turns_at.sort()
    streams: dict[int, list[Label]] = {}
    requests = []
    for at, conversation, _turn in turns_at:
        stream = streams.get(conversation)
        if stream is None:
            system = rng.randrange(shape.system_prompts)
            stream = streams[conversation] = [("s", system, i) for i in range(shape.system_tokens)]
        offset = len(stream)
        stream.extend(("c", conversation, offset + i) for i in range(shape.user_tokens))
        prompt = list(stream)
        # The answer becomes part of the next turn's prompt.
        stream.extend(("c", conversation, len(stream) + i) for i in range(shape.output_tokens))
        requests.append(
            TraceRequest(round(at * 1000, 3), len(prompt), shape.output_tokens, _chained(prompt, shape, ids))
        )
    return requests


def _chained(
    prompt: list[Label], shape: ChatTraceShape, ids: dict[tuple[int, tuple[Label, ...]], int]
) -> tuple[int, ...]:
    chain: list[int] = []
    parent = -1
    for begin in range(0, len(prompt), shape.block_size):
        key = (parent, tuple(prompt[begin : begin + shape.block_size]))
        parent = ids.setdefault(key, len(ids))
        chain.append(parent)
    return tuple(chain)
