"""`kvtune up --capture-trace DIR`: the router writes the traffic it serves as a trace, without its text.

Each request an engine answered (status below 400) becomes one trace line: its arrival in milliseconds
from the capture's start, its prompt's length in the tokens the router routed it by (chat requests through
the chat template, as vLLM renders them: prompt_tokens.py), its output tokens (capture_answers.py) and its
prompt's keyed, chained block ids at the engines' block size (kvtune/traces/hashing.py says what such a
trace reveals and what it does not). Requests the router refused, or that no engine answered, are left out.

Lines are written as requests end, yet a trace lists requests in arrival order: each router process
numbers requests as they arrive and writes an ended one once every earlier one has ended. A request still
open while MAX_HELD ended ones wait behind it (a stream that runs for hours) is left out of the capture,
so the wait and the memory stay bounded. Nothing here waits on the disk (capture_files.py) or can fail a
request.

Every router worker uses the capture's one key, handed over on its set-up pipe (never a command line or an
environment, never logged), and one time origin: `time.monotonic_ns()` reads CLOCK_MONOTONIC, one clock for
all processes of a Linux host, so `kvtune trace merge` puts every worker's lines on one time line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtune.config_errors import ConfigError
from kvtune.files import ensure_writable_folder
from kvtune.router.capture_answers import StreamTokens, whole_answer_tokens
from kvtune.router.capture_files import FILE_GLOB, CaptureWriter, RotatingFiles, capture_files
from kvtune.traces.format import TraceRequest, trace_line
from kvtune.traces.hashing import BlockHasher, new_key

log = logging.getLogger(__name__)
# Ended requests held back behind one still open, at most: each is a few hundred bytes of ids.
MAX_HELD = 4096


@dataclass(frozen=True)
class CaptureSettings:
    """One capture as every router process of it writes it (JSON-able: a worker gets it on its pipe)."""

    folder: str
    max_file_bytes: int
    keep_files: int  # per router process
    origin_ns: int  # time.monotonic_ns() when the capture started
    key_hex: str = field(repr=False)


@dataclass(frozen=True)
class CapturePlan:
    """What `--capture-trace` asks for, checked before anything starts; `start` makes the key and origin."""

    folder: Path
    max_file_bytes: int
    keep_files: int

    def check(self) -> None:
        """ConfigError when the folder cannot be written or holds an earlier capture's files."""
        ensure_writable_folder(self.folder, "--capture-trace")
        earlier = capture_files(self.folder)
        if earlier:
            raise ConfigError(
                f"--capture-trace {self.folder}: holds an earlier capture's files ({FILE_GLOB}), whose "
                "key is gone, so new ids would not match theirs; merge them "
                f"(`kvtune trace merge {self.folder} -o trace.jsonl`) and move them away, or give a new "
                "folder"
            )

    def start(self) -> CaptureSettings:
        return CaptureSettings(
            str(self.folder), self.max_file_bytes, self.keep_files, time.monotonic_ns(), new_key().hex()
        )


class TraceCapture:
    """One router process's part of a capture. Every method runs on the router's event loop."""

    def __init__(
        self,
        settings: CaptureSettings,
        block_size: int,
        worker: int,
        count_text: Callable[[str], int],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.block_size = block_size
        self._hasher = BlockHasher(bytes.fromhex(settings.key_hex), block_size)
        self._origin_ns = settings.origin_ns
        self._count_text = count_text
        self._clock = clock
        files = RotatingFiles(Path(settings.folder), worker, settings.max_file_bytes, settings.keep_files)
        self.writer = CaptureWriter(files)
        self._arrived = 0  # the number the next arrival gets
        self._next = 0  # the number of the next line to write
        self._ended: dict[int, TraceRequest | None] = {}  # ended, waiting for earlier ones (None: left out)
        self.left_out = 0
        self._closed = False

    def arrive(self) -> Ticket:
        arrival_ms = max(0.0, (self._clock() - self._origin_ns) / 1e6)
        ticket = Ticket(self, self._arrived, round(arrival_ms, 3))
        self._arrived += 1
        return ticket

    def count_whole(self, body: bytes) -> int:
        return whole_answer_tokens(body, self._count_text)

    def end(self, ticket: Ticket, tokens: Sequence[int] | None, output_tokens: int = 0) -> None:
        """TICKET's request ended: served with prompt TOKENS, or left out (None)."""
        if self._closed or ticket.number < self._next:  # the capture ended, or gave up waiting for it
            return
        request = None
        if tokens:
            ids = self._hasher.ids(tokens)
            request = TraceRequest(ticket.arrival_ms, len(tokens), output_tokens, ids)
        self._ended[ticket.number] = request
        self._write_ready()
        if len(self._ended) > MAX_HELD:
            if not self.left_out:
                log.warning(
                    "trace capture: a request open for long held %d ended ones back; requests still open "
                    "that long are left out of the capture",
                    MAX_HELD,
                )
            first_ended = min(self._ended)
            self.left_out += first_ended - self._next
            self._next = first_ended
            self._write_ready()

    def _write_ready(self) -> None:
        while self._next in self._ended:
            request = self._ended.pop(self._next)
            self._next += 1
            if request is not None:
                self.writer.put(trace_line(request, self.block_size).encode() + b"\n")

    def close(self) -> None:
        """Write every ended request (those still open are left out) and close the files."""
        if self._closed:
            return
        for number in sorted(self._ended):
            self._next = number
            self._write_ready()
        self._closed = True
        self.writer.close()


class Ticket:
    """One request's place in the capture, from its arrival to its end. Each method may be called again,
    and after the capture closed; a ticket of no capture (NO_TICKET) does nothing."""

    def __init__(self, capture: TraceCapture | None, number: int, arrival_ms: float) -> None:
        self._capture = capture
        self.number = number
        self.arrival_ms = arrival_ms
        self._state = "open"  # then "streaming" (its stream ends it) or "ended"

    def finish(self, tokens: Sequence[int] | None, output_tokens: int = 0) -> None:
        if self._capture is not None and self._state != "ended":
            self._state = "ended"
            self._capture.end(self, tokens, output_tokens)

    def answered(self, tokens: Sequence[int], body: bytes) -> None:
        """Served, its whole answer BODY."""
        if self._capture is not None and self._state == "open":
            self.finish(tokens, self._capture.count_whole(body))

    def stream(self, tokens: Sequence[int]) -> CapturedStream | None:
        """Served, its answer a stream: what the stream's bytes go through, which ends the ticket when the
        stream ends (None without a capture)."""
        if self._capture is None or self._state != "open":
            return None
        self._state = "streaming"
        return CapturedStream(self, tokens)

    def drop(self) -> None:
        """Not served: refused, or no engine answered."""
        self.finish(None)

    def unless_streaming_drop(self) -> None:
        """The request's handler is done: a ticket neither ended nor handed to its stream is dropped."""
        if self._state == "open":
            self.finish(None)


NO_TICKET = Ticket(None, 0, 0.0)


class CapturedStream:
    """A served request's streamed answer on its way to the client: its output tokens counted as it passes."""

    def __init__(self, ticket: Ticket, tokens: Sequence[int]) -> None:
        self._ticket = ticket
        self._tokens = tokens
        self._counter = StreamTokens()

    def feed(self, chunk: bytes) -> None:
        self._counter.feed(chunk)

    def end(self) -> None:
        self._ticket.finish(self._tokens, self._counter.tokens)
