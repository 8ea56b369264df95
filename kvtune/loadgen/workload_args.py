"""Each workload's own flags (name, type, default, bounds, help, KVTUNE_* env var), declared once.

The Locust files register them, `kvtune load` and the sweep spec validate against them, and the KV pruning
reads the workload's sizes (defaults included) from them. This module never imports Locust.
"""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from kvtune.loadgen.pacing import Arrival
from kvtune.traces.format import DEFAULT_TRACE_BLOCK_SIZE, MAX_BLOCK_SIZE

WorkloadName = Literal["shared_prefix", "long_doc_qa", "multi_turn", "replay", "trace"]
WORKLOAD_NAMES: tuple[str, ...] = get_args(WorkloadName)
ArgValue = int | float | str | bool

# Output tokens per request when nobody says otherwise: Locust's --max-tokens, `kvtune load` and sweeps.
DEFAULT_MAX_TOKENS = 64
# The largest load an operator would ask for (`kvtune load`, a sweep's workload, the workloads' own sizes):
# past these a value is a typo, and would otherwise surface as an exhausted host, not as a message.
# Locust users (closed loop) or requests in flight (open loop): gevent keeps a few thousand in one process.
MOST_USERS = 10_000
# Locust worker processes (`--workers`): each holds a tokenizer, ~150 MB, and a core to be worth starting.
MOST_WORKERS = 64
# Output tokens per request: the longest context windows served today are 128 Ki tokens.
MOST_MAX_TOKENS = 131_072
# Tokens of one part of a prompt (a system prompt, a document, a turn): the longest context, 1 Mi tokens.
MOST_PROMPT_TOKENS = 1_048_576
# Documents, turns, load steps: a count of things in one conversation or one test.
MOST_PARTS = 10_000
# Open-loop arrival rate, requests per second: past any one engine's (or fleet's) capacity.
MOST_RATE = 100_000.0
# The engine's API key reaches the Locust users through this environment variable only: never argv.
API_KEY_ENV = "KVTUNE_API_KEY"
# The runner creates this file beside the samples once a window holds its count of requests: every Locust user
# that sees it sends nothing more.
STOP_FILE = "stop-sending"
# Flags every Locust file has (kvtune.loadgen.locust_flags): set outside a workload's own args.
COMMON_FLAGS = ("max-tokens", "ignore-eos", "model", "tokenizer", "arrival", "arrival-rate", "seed")


class WorkloadError(ValueError):
    """Bad workload input (a flag, a size, a replay file); str() names the flag or place and the fix."""


@dataclass(frozen=True)
class WorkloadArg:
    """One flag of a workload: `--{flag}` on Locust's command line, `KVTUNE_{FLAG}` in its environment."""

    flag: str
    kind: type[int] | type[float] | type[str] | type[bool]
    default: ArgValue | None
    help: str
    minimum: float | None = None
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None
    required: bool = False
    example: str = ""
    file: bool = False  # a path to an existing file, resolved against the spec's folder

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def env_var(self) -> str:
        return "KVTUNE_" + self.dest.upper()

    def parse(self, value: object) -> ArgValue:
        """The value as this flag's type, within its bounds; WorkloadError names the flag and the fix."""
        problem, parsed = self._convert(value)
        if problem is None and parsed is not None:
            problem = self._bounds_problem(parsed)
        if problem is not None or parsed is None:
            raise WorkloadError(f"{self.flag}: {problem}")
        return parsed

    def _convert(self, value: object) -> tuple[str | None, ArgValue | None]:
        fix = f"e.g. {self.flag}={self.example}" if self.example else f"see --{self.flag}"
        if self.kind is bool:
            if isinstance(value, bool):
                return None, value
            text = str(value).strip().lower()
            if text in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return None, text in ("true", "1", "yes", "on")
            return f"{value!r} is not true or false", None
        if self.kind is str:
            if isinstance(value, str) and value.strip():
                return None, value
            return f"{value!r} is not a non-empty text; {fix}", None
        if isinstance(value, bool):  # YAML `true` is an int to Python, never a size
            return f"{value!r} is not a number; {fix}", None
        if self.kind is int:
            if isinstance(value, int):
                return None, value
            if isinstance(value, float) and value.is_integer():
                return None, int(value)
            try:
                return None, int(str(value).strip())
            except ValueError:
                return f"{value!r} is not an integer; give a whole number, {fix}", None
        if isinstance(value, int | float):
            return None, float(value)
        try:
            return None, float(str(value).strip())
        except ValueError:
            return f"{value!r} is not a number; {fix}", None

    def _bounds_problem(self, value: ArgValue) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        fix = f"e.g. {self.flag}={self.example}"
        if not math.isfinite(value):
            return f"{value} is not a finite number; {fix}"
        if self.minimum is not None and value < self.minimum:
            return f"{value} is below {self.minimum:g}; give at least {self.minimum:g}, {fix}"
        if self.above is not None and value <= self.above:
            return f"{value} must be above {self.above:g}, {fix}"
        if self.maximum is not None and value > self.maximum:
            span = f"{_shown(self.minimum or 0)}..{_shown(self.maximum)}"
            return f"{value} is outside {span}; give a value within {span}, {fix}"
        return None

    @property
    def bounds(self) -> str:
        """The values it takes, for help texts ("1 to 1,048,576"); empty when it has no upper bound."""
        if self.maximum is None:
            return ""
        low = f"above {_shown(self.above)}" if self.above is not None else _shown(self.minimum or 0)
        return f"{low} to {_shown(self.maximum)}"

    def argparse_type(self, text: str) -> ArgValue:
        """For argparse: a bad value becomes a usage error (exit 2) with the same reason."""
        try:
            return self.parse(text)
        except WorkloadError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{self.flag}: ")) from None


def _shown(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:g}"


def _size(flag: str, default: int, help_text: str, most: int = MOST_PROMPT_TOKENS) -> WorkloadArg:
    """A token size (or, with MOST, a count) of 1 to MOST."""
    return WorkloadArg(flag, int, default, help_text, minimum=1, maximum=most, example=str(default))


WORKLOAD_ARGS: dict[str, tuple[WorkloadArg, ...]] = {
    "shared_prefix": (
        _size("system-tokens", 800, "tokens of the shared system prompt"),
        _size("user-tokens", 400, "tokens of each user message"),
        WorkloadArg(
            "prefix-reuse",
            float,
            None,
            "target share of prompt tokens shared by all requests, 0-1 (default: the system prompt's share)",
            minimum=0.0,
            maximum=1.0,
            example="0.5",
        ),
    ),
    "long_doc_qa": (
        _size("num-docs", 2, "documents asked about", MOST_PARTS),
        _size("doc-tokens", 3000, "tokens per document, within max_model_len"),
        _size("question-tokens", 32, "tokens per question"),
    ),
    "multi_turn": (
        _size("turns", 4, "turns per conversation", MOST_PARTS),
        _size("turn-tokens", 200, "tokens of each user turn"),
    ),
    "replay": (
        WorkloadArg(
            "replay-file",
            str,
            None,
            "JSONL file of prompts or chat messages",
            required=True,
            example="prompts.jsonl",
            file=True,
        ),
    ),
    "trace": (
        WorkloadArg(
            "trace-file",
            str,
            None,
            "JSONL trace: hash-block lines (timestamp, input_length, output_length, hash_ids) or prompts / "
            "chat messages with an optional timestamp (ms)",
            required=True,
            example="trace.jsonl",
            file=True,
        ),
        WorkloadArg(
            "trace-block-size",
            int,
            None,
            "the trace's tokens per hash id (default: the lines' block_size, else "
            f"{DEFAULT_TRACE_BLOCK_SIZE})",
            minimum=1,
            maximum=MAX_BLOCK_SIZE,
            example=str(DEFAULT_TRACE_BLOCK_SIZE),
        ),
        WorkloadArg(
            "tokens-per-block",
            int,
            None,
            "engine tokens per trace block, a multiple of the engine's block size (default: the engine's "
            "block size, read from its /metrics)",
            minimum=1,
            maximum=MAX_BLOCK_SIZE,
            example="128",
        ),
        WorkloadArg(
            "time-scale",
            float,
            1.0,
            "multiplies the trace's gaps between arrivals (0.5: twice as fast)",
            above=0.0,
            maximum=1000.0,
            example="0.5",
        ),
        WorkloadArg(
            "trace-start", int, 0, "index of the trace's first request replayed", minimum=0, example="0"
        ),
        WorkloadArg(
            "trace-count", int, None, "most requests replayed (default: all)", minimum=1, example="100"
        ),
        WorkloadArg(
            "trace-duration",
            float,
            None,
            "seconds of the trace replayed from its first request, before time-scale (default: all)",
            above=0.0,
            example="600",
        ),
        WorkloadArg(
            "trace-sample",
            float,
            1.0,
            "share of whole conversations kept, above 0 and at most 1",
            above=0.0,
            maximum=1.0,
            example="0.25",
        ),
        WorkloadArg(
            "output-scale",
            float,
            None,
            "engine output tokens per trace output token (default: the prompts' scale, tokens-per-block / "
            "trace-block-size)",
            above=0.0,
            maximum=1000.0,
            example="1",
        ),
    ),
}

# How requests arrive when nobody says: a trace at its own times, every other workload in a closed loop.
DEFAULT_ARRIVAL: dict[str, Arrival] = {"trace": "trace"}


def default_arrival(workload: str) -> Arrival:
    return DEFAULT_ARRIVAL.get(workload, "closed")


# The load shape's flags (loadtests/step_shape.py): not a workload, registered the same way.
STEP_SHAPE_ARGS: tuple[WorkloadArg, ...] = (
    _size("step-users", 2, "users added at each step", MOST_USERS),
    WorkloadArg("step-seconds", float, 30.0, "how long each level holds", above=0.0, example="30"),
    _size("steps", 4, "number of levels before the test ends", MOST_PARTS),
    WorkloadArg("ramp", bool, False, "add each step's users gradually, not at once"),
)


def workload_args(workload: str) -> tuple[WorkloadArg, ...]:
    if workload not in WORKLOAD_ARGS:
        near = difflib.get_close_matches(workload, WORKLOAD_NAMES, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise WorkloadError(f"{workload!r} is not a workload; {hint}workloads: {', '.join(WORKLOAD_NAMES)}")
    return WORKLOAD_ARGS[workload]


def add_arguments(parser: Any, definitions: tuple[WorkloadArg, ...]) -> None:
    """Register flags on Locust's parser (configargparse: `env_var` reads KVTUNE_* variables)."""
    for arg in definitions:
        shown = "" if arg.default is None else f" (default: {arg.default})"
        if arg.kind is bool:
            parser.add_argument(f"--{arg.flag}", env_var=arg.env_var, action="store_true", help=arg.help)
            continue
        parser.add_argument(
            f"--{arg.flag}",
            env_var=arg.env_var,
            type=arg.argparse_type,
            default=arg.default,
            help=arg.help + shown,
        )


def flags_help() -> str:
    """Each workload's flags with their defaults, for `kvtune load --help`."""
    lines = ["workload flags (--arg NAME=VALUE; a Locust file takes --NAME or KVTUNE_NAME):"]
    for workload, definitions in WORKLOAD_ARGS.items():
        lines.append(f"  {workload}:")
        for arg in definitions:
            default = (
                "required" if arg.required else f"default {arg.default}" if arg.default is not None else ""
            )
            said = ", ".join(part for part in (arg.bounds, default) if part)
            lines.append(f"    {arg.flag:<16} {arg.help}" + (f" ({said})" if said else ""))
    return "\n".join(lines)


def validate_workload_args(
    workload: str, args: Mapping[str, str | int | float], *, base_dir: Path | None = None
) -> dict[str, int | float | str]:
    """`args` of `workload` typed and checked: flags (with or without `--`) -> values.

    Raises WorkloadError naming the flag and the fix: an unknown flag (with the nearest known one), a value
    of the wrong type, a size below 1, a share outside 0..1, a missing replay or trace file. A relative file
    is resolved against `base_dir` (default: the working directory) and returned absolute.
    """
    definitions = {arg.flag: arg for arg in workload_args(workload)}
    checked: dict[str, int | float | str] = {}
    for raw_flag, value in args.items():
        flag = raw_flag.removeprefix("--")
        arg = definitions.get(flag)
        if arg is None:
            raise WorkloadError(_unknown_flag(workload, flag, list(definitions)))
        parsed = arg.parse(value)
        checked[flag] = str(parsed).lower() if isinstance(parsed, bool) else parsed
    for arg in definitions.values():
        if arg.required and arg.flag not in checked:
            raise WorkloadError(
                f"{arg.flag}: the {workload} workload needs a {arg.help} "
                f"(--{arg.flag} {arg.example}, or {arg.flag}: {arg.example} in a sweep spec)"
            )
    for arg in definitions.values():
        if arg.file and arg.flag in checked:
            checked[arg.flag] = str(_existing_file(arg, str(checked[arg.flag]), base_dir))
    return checked


def _unknown_flag(workload: str, flag: str, known: list[str]) -> str:
    if flag in COMMON_FLAGS:
        return (
            f"{flag}: a load setting, not a flag of the {workload} workload; set it outside the workload's "
            f"args (kvtune load --{flag}, sweep workload.{flag.replace('-', '_')})"
        )
    near = difflib.get_close_matches(flag, known, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"{flag}: not a flag of the {workload} workload; {hint}its flags: {', '.join(known)}"


def _existing_file(arg: WorkloadArg, value: str, base_dir: Path | None) -> Path:
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    try:
        exists = path.is_file()
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        exists = False
    if not exists:
        raise WorkloadError(
            f"{arg.flag}: {path} does not exist or is not a file; pass an existing {arg.help.split(':')[0]}"
        )
    return path


@dataclass(frozen=True)
class WorkloadSizes:
    """Every flag of one workload with its value: the given one, else the declared default."""

    workload: str
    values: dict[str, int | float | str | None]

    def count(self, flag: str) -> int:
        value = self.values[flag]
        if not isinstance(value, int):
            raise TypeError(f"{self.workload} flag {flag} is not a count")
        return value

    def share(self, flag: str) -> float | None:
        value = self.values[flag]
        return None if value is None else float(value)


def workload_sizes(workload: str, args: Mapping[str, str | int | float]) -> WorkloadSizes:
    """The workload's sizes as it will run them: validated `args` over the declared defaults."""
    checked = validate_workload_args(workload, args)
    values: dict[str, int | float | str | None] = {
        arg.flag: None if isinstance(arg.default, bool) else arg.default for arg in workload_args(workload)
    }
    return WorkloadSizes(workload, values | dict(checked))
