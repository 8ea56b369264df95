"""`kvtune trace convert LOG -o OUT`: a log of OpenAI-style requests as a trace without its text.

Each line of LOG is a request body as a client sent it: `{"messages": [...]}` (a chat, rendered by the
model's chat template as vLLM renders it) or `{"prompt": "..."}` (a completion, with the tokenizer's special
tokens, as vLLM adds them; a list of token ids is taken as it is), with an optional `timestamp` in
milliseconds (any origin: the trace starts at the earliest) and the output's length as `output_tokens` (what
was generated) or `max_tokens` / `max_completion_tokens` (the cap the client set). Prompts are tokenised the
way the router tokenises them (kvtune/router/prompt_tokens.py) and hashed at the engines' block size with a
key made for this conversion and then forgotten (kvtune/traces/hashing.py): the trace keeps arrival times,
sizes and which requests share which prefixes, never the text or the token ids.
"""

from __future__ import annotations

import argparse
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from kvtune.commands.common import ExitCode, add_cache_dir_flag, count, positive_count, positive_number
from kvtune.config_errors import ConfigError
from kvtune.files import output_file_problem, write_atomic
from kvtune.model_store import DEFAULT_MODEL, ModelPrepareError, known_models, resolve_model
from kvtune.profile import load_profile
from kvtune.router.prompt_tokens import ChatTokenizer, PromptEncoder, prompt_tokens
from kvtune.traces.format import (
    MAX_BLOCKS,
    MAX_REQUESTS,
    MAX_TIMESTAMP_MS,
    MAX_TOKENS,
    TraceError,
    TraceRequest,
    numbered_lines,
    parse_line,
    write_trace,
)
from kvtune.traces.hashing import BlockHasher, new_key

console = Console(stderr=True, soft_wrap=True)
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
# Where a line gives its output's length, best first: what was generated, then the caps a client sets.
OUTPUT_FIELDS = ("output_tokens", "max_tokens", "max_completion_tokens")
# Timestamps are milliseconds of any origin (Unix time included); past this they are not milliseconds.
MAX_LOG_TIMESTAMP_MS = 1e15


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", type=Path, metavar="LOG", help="JSONL of request bodies (messages or prompt)")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT", help="the trace to write")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="MODEL_OR_PROFILE",
        help="whose tokenizer the prompts are counted in: an embedded model, a model folder, a Hugging Face "
        "id, or an engine profile (.yaml: its model, revision and block size) (default %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=positive_count,
        default=None,
        help="tokens each hash id stands for: the engines' block size (default: the profile's)",
    )
    parser.add_argument(
        "--output-tokens",
        type=count,
        default=None,
        metavar="N",
        help=f"output length of lines that give none of {', '.join(OUTPUT_FIELDS)} (default: such a "
        "line is refused)",
    )
    parser.add_argument(
        "--gap-ms",
        type=positive_number,
        default=None,
        metavar="MS",
        help="a line without a timestamp comes this many ms after the line before it (default: such a "
        "line is refused)",
    )
    add_cache_dir_flag(parser)


@dataclass(frozen=True)
class LogRules:
    """How lines that leave something out are read (None: refused)."""

    output_tokens: int | None = None
    gap_ms: float | None = None


def main(args: argparse.Namespace) -> int:
    problem = output_file_problem(args.output)
    if problem is not None:
        raise ConfigError(f"-o {args.output}: {problem}")
    try:
        tokenizer, block_size = load_tokenizer(args.model, args.block_size, args.cache_dir)
    except ModelPrepareError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return ExitCode.FAILED
    hasher = BlockHasher(new_key(), block_size)
    requests, reordered = convert_log(
        args.log, PromptEncoder(tokenizer), hasher, LogRules(args.output_tokens, args.gap_ms)
    )
    text = io.StringIO()
    write_trace(text, requests, block_size)
    write_atomic(args.output, text.getvalue())
    sorted_note = f"; {reordered:,} lines were out of time order and are sorted" if reordered else ""
    console.print(
        f"Wrote {len(requests):,} requests ({sum(len(r.hash_ids) for r in requests):,} blocks of "
        f"{block_size} tokens{sorted_note}) to {args.output}: arrival times, sizes and shared prefixes, "
        "no text",
        highlight=False,
    )
    return ExitCode.OK


def load_tokenizer(model: str, block_size: int | None, cache_dir: Path | None) -> tuple[ChatTokenizer, int]:
    """The tokenizer MODEL names (a profile: its model at its revision) and the block size: BLOCK_SIZE, else
    the profile's. ConfigError when there is neither, or the tokenizer cannot load."""
    revision = None
    if Path(model).suffix in (".yaml", ".yml"):
        profile = load_profile(Path(model))
        model, revision = profile.model, profile.revision
        block_size = block_size or profile.effective_block_size
    if block_size is None:
        raise ConfigError(
            "--block-size: give the engines' block size (the tokens each hash id stands for), or pass "
            "--model PROFILE.yaml to take the profile's"
        )
    location = resolve_model(model, cache_dir)
    from kvtune.loadgen.text import load_tokenizer as load  # transformers: slow to import

    try:
        tokenizer: Any = load(location, revision)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"--model {model}: its tokenizer cannot be loaded ({str(exc).splitlines()[0][:200]}); give an "
            f"embedded model ({known_models()}), a model folder, a Hugging Face id or an engine profile"
        ) from None
    return tokenizer, block_size


def convert_log(
    path: Path, encoder: PromptEncoder, hasher: BlockHasher, rules: LogRules
) -> tuple[list[TraceRequest], int]:
    """The requests of the log at PATH in arrival order, from time 0, and how many lines were out of order.
    TraceError naming the line and the fix for a line that cannot be read."""
    rows: list[TraceRequest] = []
    blocks, reordered, previous = 0, 0, None
    for number, raw in numbered_lines(path, "a request log (JSONL of request bodies)"):
        where = f"{path}:{number}"
        item = parse_line(raw, where)
        if not isinstance(item, dict):
            raise TraceError(f"{where}: expected a JSON object with 'messages' or 'prompt'")
        timestamp = _timestamp(item.get("timestamp"), where, previous, rules.gap_ms)
        output = _output_length(item, where, rules.output_tokens)
        tokens = _tokens(encoder, item, where)
        ids = hasher.ids(tokens)
        blocks += len(ids)
        if len(rows) >= MAX_REQUESTS or blocks > MAX_BLOCKS:
            raise TraceError(
                f"{where}: the log holds more than {MAX_REQUESTS:,} requests or {MAX_BLOCKS:,} blocks, more "
                "than one trace holds; cut it into parts (e.g. split -l) and convert each"
            )
        reordered += previous is not None and timestamp < previous
        rows.append(TraceRequest(timestamp, len(tokens), output, ids))
        previous = timestamp
    if not rows:
        raise TraceError(
            f"{path}: holds no requests; each line is a request body with 'messages' or 'prompt'"
        )
    rows.sort(key=lambda request: request.timestamp_ms)  # stable: equal times keep the log's order
    start, end = rows[0].timestamp_ms, rows[-1].timestamp_ms
    if end - start > MAX_TIMESTAMP_MS:
        raise TraceError(
            f"{path}: its timestamps span {(end - start) / 3.6e6:,.0f} hours, more than a trace's ten years; "
            "are they milliseconds?"
        )
    shifted = [
        TraceRequest(round(r.timestamp_ms - start, 3), r.input_length, r.output_length, r.hash_ids)
        for r in rows
    ]
    return shifted, reordered


def _timestamp(value: Any, where: str, previous: float | None, gap_ms: float | None) -> float:
    if value is None:
        if gap_ms is None:
            raise TraceError(
                f"{where}: no timestamp; give every line a 'timestamp' in milliseconds, or pass --gap-ms MS "
                "to place a line without one MS after the line before it"
            )
        return 0.0 if previous is None else previous + gap_ms
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: timestamp is not a number; give milliseconds (e.g. Unix time * 1000)")
    if not (math.isfinite(value) and 0 <= value <= MAX_LOG_TIMESTAMP_MS):
        raise TraceError(f"{where}: timestamp {value:g} is not a time in milliseconds; fix the line")
    return float(value)


def _output_length(item: dict[str, Any], where: str, default: int | None) -> int:
    for field in OUTPUT_FIELDS:
        value = item.get(field)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
            raise TraceError(f"{where}: {field} is not a whole number of tokens in 0..{MAX_TOKENS:,}")
        return value
    if default is None:
        raise TraceError(
            f"{where}: no output length; give the line one of {', '.join(OUTPUT_FIELDS)}, or pass "
            "--output-tokens N for lines without one"
        )
    return default


def _tokens(encoder: PromptEncoder, item: dict[str, Any], where: str) -> list[int]:
    if "messages" in item and "prompt" in item:
        raise TraceError(f"{where}: has both 'messages' and 'prompt'; a request is a chat or a completion")
    if "messages" not in item and "prompt" not in item:
        raise TraceError(f"{where}: has neither 'messages' (a chat) nor 'prompt' (a completion)")
    try:
        tokens = prompt_tokens(encoder, item, CHAT if "messages" in item else COMPLETION)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:  # messages never quoted: text stays out
        raise TraceError(f"{where}: the prompt cannot be read ({exc}); fix the line") from None
    if not tokens:
        raise TraceError(f"{where}: the prompt has no tokens; a trace's requests have at least one")
    return tokens
