"""The hash-block trace format, read strictly and written the same way.

One JSON object a line, as Mooncake's published traces (FAST'25) and aiperf's `mooncake_trace` have them:
`timestamp` (milliseconds from the trace's start), `input_length` and `output_length` (tokens) and
`hash_ids` (one id per block of `block_size` prompt tokens, 512 in Mooncake's traces; equal ids are equal
blocks, and ids are chained: an id stands for its whole prefix, so it always follows the same id). kvtune
writes an optional `block_size` on every line of the traces it makes (a captured or converted trace is in
the engine's block size, not 512), and reads it when present.

A trace may hold a day of traffic: it is read line by line with every line, the number of requests and the
number of blocks bounded, and every refusal names the line, the field and the fix without quoting the line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvtune.config_errors import ConfigError
from kvtune.documents import open_regular

# Mooncake's traces hash prompts in blocks of 512 tokens.
DEFAULT_TRACE_BLOCK_SIZE = 512
# One request a line: 4 MiB holds ~400,000 hash ids, a prompt of 200 million tokens at 512 a block.
MAX_LINE_BYTES = 4 * 1024 * 1024
# What one run holds in memory: Mooncake's hour-long conversation trace is 12,031 requests and ~300,000
# blocks; a month of such traffic fits under these bounds, a runaway file does not fill memory.
MAX_REQUESTS = 2_000_000
MAX_BLOCKS = 20_000_000
# A timestamp past ten years, a prompt past 100 million tokens, an id past 2**63: not a trace's numbers.
MAX_TIMESTAMP_MS = 10 * 365 * 24 * 3600 * 1000
MAX_TOKENS = 100_000_000
MAX_HASH_ID = 2**63 - 1
MAX_BLOCK_SIZE = 1 << 20
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ConfigError):
    """A trace that cannot be used; str() names the file, the line, the field and the fix."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrived, its sizes in tokens and its prompt's chained block ids."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def full_blocks(self, block_size: int) -> int:
        """Blocks of the prompt that are whole (a prefix cache keeps and matches only these)."""
        return self.input_length // block_size


@dataclass(frozen=True)
class Trace:
    """A whole trace: its block size and its requests in arrival order."""

    block_size: int
    requests: tuple[TraceRequest, ...]
    source: str = "a trace"

    @property
    def duration_ms(self) -> float:
        return self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms if self.requests else 0.0


def trace_line(request: TraceRequest, block_size: int | None = None) -> str:
    """One request as a trace line (with `block_size` when given: kvtune's own traces carry it)."""
    item: dict[str, Any] = {
        "timestamp": _compact(request.timestamp_ms),
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": list(request.hash_ids),
    }
    if block_size is not None:
        item["block_size"] = block_size
    return json.dumps(item, separators=(",", ":"))


def write_trace(file: IO[str], requests: Iterable[TraceRequest], block_size: int | None = None) -> int:
    """Write REQUESTS as trace lines; returns how many."""
    count = 0
    for request in requests:
        file.write(trace_line(request, block_size) + "\n")
        count += 1
    return count


def _compact(value: float) -> float | int:
    return int(value) if float(value).is_integer() else round(value, 3)


def is_block_trace(first_item: Any) -> bool:
    """True when a trace line holds hash ids (a text trace holds messages or a prompt instead)."""
    return isinstance(first_item, dict) and "hash_ids" in first_item


def numbered_lines(path: Path, kind: str) -> Iterator[tuple[int, bytes]]:
    """The non-blank numbered lines of a JSONL file: a regular file (a FIFO or a device is refused, never read
    forever), each line at most MAX_LINE_BYTES."""
    try:
        with open_regular(path, kind) as file:
            for number, raw in enumerate(iter(lambda: file.readline(MAX_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_LINE_BYTES:
                    raise TraceError(
                        f"{path}:{number}: longer than {MAX_LINE_BYTES // 2**20} MiB; each line must be one "
                        "JSON request (is this a trace?)"
                    )
                if raw.strip():
                    yield number, raw
    except ConfigError as exc:
        if isinstance(exc, TraceError):
            raise
        raise TraceError(str(exc)) from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot be read ({exc.strerror or exc}); check the path") from None


def parse_line(raw: bytes, where: str) -> Any:
    """One JSON line; TraceError naming `where` (never quoting the line: a trace may hold text)."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise TraceError(f"{where}: not UTF-8 text; a trace is JSON lines") from None
    except json.JSONDecodeError as exc:
        raise TraceError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object"
        ) from None
    except _NotANumber as exc:
        raise TraceError(f"{where}: holds {exc}, which is not a number; write a finite number") from None
    except (ValueError, RecursionError):
        raise TraceError(f"{where}: holds a number or nesting too large to read; fix the line") from None


class _NotANumber(ValueError):
    """NaN or Infinity, which Python's JSON reader accepts and JSON does not."""


def _no_constant(name: str) -> float:
    raise _NotANumber(name)


def read_trace(path: Path, block_size: int | None = None) -> Trace:
    """The hash-block trace in PATH. BLOCK_SIZE is the trace's tokens per hash id: given, it must agree with
    any `block_size` the lines carry; not given, the lines' own, else Mooncake's 512."""
    reader = _BlockTraceReader(path, block_size)
    for number, raw in numbered_lines(path, "a trace (JSONL of requests)"):
        reader.add(parse_line(raw, f"{path}:{number}"), number)
    return reader.finish()


class _BlockTraceReader:
    """Checks each line as it comes: fields, bounds, order, lengths against ids, and the chain of ids."""

    def __init__(self, path: Path, block_size: int | None) -> None:
        if block_size is not None and not 1 <= block_size <= MAX_BLOCK_SIZE:
            raise TraceError(f"trace block size {block_size} must be between 1 and {MAX_BLOCK_SIZE:,}")
        self.path = path
        self.given_block_size = block_size
        self.block_size: int | None = block_size
        self.block_size_line: int | None = None
        self.requests: list[TraceRequest] = []
        self.blocks = 0
        # Each id's parent (the id before it; -1 at a prompt's start) and the first line that showed it.
        self.parents: dict[int, tuple[int, int]] = {}
        self.last_timestamp = -math.inf

    def add(self, item: Any, number: int) -> None:
        where = f"{self.path}:{number}"
        if not isinstance(item, dict):
            raise TraceError(f"{where}: expected a JSON object with {', '.join(FIELDS)}")
        missing = [name for name in FIELDS if name not in item]
        if missing:
            hint = (
                " (a text trace holds 'messages' or 'prompt' in every line)" if "hash_ids" in missing else ""
            )
            raise TraceError(
                f"{where}: missing {', '.join(missing)}; every line needs {', '.join(FIELDS)}{hint}"
            )
        block_size = self._line_block_size(item.get("block_size"), where, number)
        timestamp = _number(item["timestamp"], where, "timestamp", MAX_TIMESTAMP_MS)
        if timestamp < self.last_timestamp:
            raise TraceError(
                f"{where}: timestamp {timestamp:g} ms is before the previous line's "
                f"{self.last_timestamp:g} ms; a trace lists requests in arrival order (sort it by timestamp)"
            )
        input_length = _count(item["input_length"], where, "input_length", 1)
        output_length = _count(item["output_length"], where, "output_length", 0)
        ids = _hash_ids(item["hash_ids"], where)
        expected = -(-input_length // block_size)
        if len(ids) != expected:
            raise TraceError(
                f"{where}: input_length {input_length:,} at {block_size} tokens a block needs {expected:,} "
                f"hash_ids, the line has {len(ids):,}; check the trace's block size (--trace-block-size)"
            )
        self._check_chain(ids, where, number)
        self.blocks += len(ids)
        if len(self.requests) >= MAX_REQUESTS or self.blocks > MAX_BLOCKS:
            raise TraceError(
                f"{where}: the trace holds more than {MAX_REQUESTS:,} requests or {MAX_BLOCKS:,} blocks, "
                "more than one run reads; cut it into windows (e.g. split -l) and use one"
            )
        self.last_timestamp = timestamp
        self.requests.append(TraceRequest(timestamp, input_length, output_length, ids))

    def _line_block_size(self, value: Any, where: str, number: int) -> int:
        if value is None:
            if self.block_size is None:
                self.block_size = DEFAULT_TRACE_BLOCK_SIZE
            return self.block_size
        size = _count(value, where, "block_size", 1, MAX_BLOCK_SIZE)
        if self.block_size is None:
            self.block_size, self.block_size_line = size, number
        elif size != self.block_size:
            earlier = (
                f"--trace-block-size {self.given_block_size}"
                if self.given_block_size is not None and self.block_size_line is None
                else f"line {self.block_size_line or 'before'}'s {self.block_size}"
            )
            raise TraceError(
                f"{where}: block_size {size} disagrees with {earlier}; a trace has one block size"
            )
        return size

    def _check_chain(self, ids: tuple[int, ...], where: str, number: int) -> None:
        parent = -1
        for position, block_id in enumerate(ids):
            seen = self.parents.get(block_id)
            if seen is None:
                self.parents[block_id] = (parent, number)
            elif seen[0] != parent:
                raise TraceError(
                    f"{where}: hash_ids[{position}] = {block_id} follows a different prefix than on line "
                    f"{seen[1]}; ids are chained (equal ids mean equal prefixes), so each id must always "
                    "follow the same id: regenerate the ids with a chained hash"
                )
            parent = block_id

    def finish(self) -> Trace:
        if not self.requests:
            raise TraceError(f"{self.path}: holds no requests; a trace is JSON lines of {', '.join(FIELDS)}")
        return Trace(self.block_size or DEFAULT_TRACE_BLOCK_SIZE, tuple(self.requests), str(self.path))


def _kind(value: Any) -> str:
    kinds = {bool: "true or false", str: "a string", list: "a list", dict: "an object", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def _number(value: Any, where: str, field: str, most: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(f"{where}: {field} is {_kind(value)}, not a number of milliseconds")
    if not math.isfinite(value) or not 0 <= value <= most:
        raise TraceError(
            f"{where}: {field} {value:g} is outside 0..{most:g}; give milliseconds from the start"
        )
    return float(value)


def _count(value: Any, where: str, field: str, least: int, most: int = MAX_TOKENS) -> int:
    whole = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and value.is_integer() and math.isfinite(value):
        value, whole = int(value), True
    if not whole:
        raise TraceError(f"{where}: {field} is {_kind(value)}, not a whole number")
    if not least <= value <= most:
        raise TraceError(f"{where}: {field} {value:,} is outside {least}..{most:,}; fix the line")
    return int(value)


def _hash_ids(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError(f"{where}: hash_ids is {_kind(value)}, not a list of whole numbers")
    for position, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_HASH_ID:
            shown = f"{item:,}" if isinstance(item, int) and not isinstance(item, bool) else _kind(item)
            raise TraceError(
                f"{where}: hash_ids[{position}] is {shown}, not a whole number in 0..2**63-1; "
                "each block's id is a non-negative integer"
            )
    return tuple(value)
