"""`kvtune trace generate -o OUT`: a synthetic multi-turn chat trace (kvtune/traces/synthetic.py), to try
`kvtune trace` without a trace of one's own.

Its flags are ChatTraceShape's fields (`conversation_rate` is `--conversation-rate`), with their defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import typing
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from kvtune.commands.common import ExitCode, count, positive_count, positive_number
from kvtune.config_errors import ConfigError
from kvtune.files import output_file_problem, write_atomic
from kvtune.traces.format import MAX_BLOCKS, MAX_REQUESTS, write_trace
from kvtune.traces.synthetic import ChatTraceShape, chat_trace

console = Console(stderr=True, soft_wrap=True)
# synthetic.py keeps every conversation's tokens as labels, ~90 bytes each (5,000 conversations of the
# default shape: 2.5 million labels, 230 MiB, 2 s): this many at most keeps a run under ~500 MiB.
MAX_GENERATED_TOKENS = 5_000_000
HELP = {
    "conversations": "conversations in the trace",
    "system_prompts": "system prompts the conversations share (each conversation starts with one)",
    "system_tokens": "tokens of each system prompt",
    "turns": "most turns a conversation has (each has 1 to this many, evenly)",
    "user_tokens": "tokens each user turn adds",
    "output_tokens": "tokens of each answer (the next turn resends it)",
    "block_size": "tokens each hash id stands for",
    "conversation_rate": "new conversations per second (Poisson arrivals)",
    "think_s": "mean seconds between a conversation's turns (exponential)",
    "seed": "the same seed gives the same trace",
}


def _flag_type(name: str, kind: type) -> Callable[[str], int | float]:
    if kind is float:
        return positive_number
    return count if name == "seed" else positive_count


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT", help="the trace to write")
    kinds = typing.get_type_hints(ChatTraceShape)
    for field in dataclasses.fields(ChatTraceShape):
        parser.add_argument(
            "--" + field.name.replace("_", "-"),
            dest=field.name,
            type=_flag_type(field.name, kinds[field.name]),
            metavar="X" if kinds[field.name] is float else "N",
            default=field.default,
            help=f"{HELP[field.name]} (default %(default)s)",
        )


def check(shape: ChatTraceShape) -> None:
    """ConfigError for a shape whose trace would exceed what one trace holds, or the memory kept making it."""
    requests = shape.conversations * shape.turns
    longest = shape.system_tokens + shape.turns * (shape.user_tokens + shape.output_tokens)
    blocks = requests * math.ceil(longest / shape.block_size)
    tokens = shape.conversations * longest
    if requests > MAX_REQUESTS or blocks > MAX_BLOCKS or tokens > MAX_GENERATED_TOKENS:
        raise ConfigError(
            f"--conversations {shape.conversations} of up to --turns {shape.turns} could make {requests:,} "
            f"requests, {blocks:,} blocks and {tokens:,} tokens of conversation, more than kvtune generates "
            f"({MAX_REQUESTS:,}, {MAX_BLOCKS:,} and {MAX_GENERATED_TOKENS:,}); make fewer conversations, "
            "turns or tokens"
        )


def main(args: argparse.Namespace) -> int:
    problem = output_file_problem(args.output)
    if problem is not None:
        raise ConfigError(f"-o {args.output}: {problem}")
    shape = ChatTraceShape(
        **{field.name: getattr(args, field.name) for field in dataclasses.fields(ChatTraceShape)}
    )
    check(shape)
    requests = chat_trace(shape)
    text = io.StringIO()
    write_trace(text, requests, shape.block_size)
    write_atomic(args.output, text.getvalue())
    span_s = requests[-1].timestamp_ms / 1000 if requests else 0.0
    console.print(
        f"Wrote {len(requests):,} requests of {shape.conversations:,} conversations ({span_s:,.0f} s of "
        f"traffic, blocks of {shape.block_size} tokens) to {args.output}",
        highlight=False,
    )
    return ExitCode.OK
