"""A capture's files: each router process appends whole trace lines to its own numbered files, rotated at a
size and bounded in number (the oldest deleted), from a thread of its own so no request waits on a disk.

Files are `capture-w<worker>-<number>.jsonl` (worker 0 is the router inside `kvtune up`). A worker that is
started again continues its own numbering, so nothing is overwritten. A line is appended with one write()
(a signal cannot split it on a regular file); a write that fails part-way (a full disk) is cut back to
the last whole line, then the capture stops and says so once: the router keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kvtune.files import child_path, name_problem

log = logging.getLogger(__name__)
FILE_GLOB = "capture-w*-*.jsonl"
_FILE = re.compile(r"capture-w(?P<worker>\d+)-(?P<number>\d+)\.jsonl")
# Lines waiting for the disk: a few MiB at ~200-2,000 bytes a line. A disk slower than the traffic for
# this long loses lines (counted and logged), never a request's time.
MAX_QUEUED_LINES = 8192
# Capture files are readable by their owner only: a trace shows when and how much the users sent.
FILE_MODE = 0o600


def capture_files(folder: Path, worker: int | None = None) -> list[tuple[int, int, Path]]:
    """(worker, number, path) of the capture files in FOLDER (of WORKER alone when given), oldest first."""
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for path in folder.iterdir():
            match = _FILE.fullmatch(path.name)
            if match and (worker is None or int(match["worker"]) == worker):
                found.append((int(match["worker"]), int(match["number"]), path))
    return sorted(found)


def file_name(worker: int, number: int) -> str:
    name = f"capture-w{worker}-{number:06d}.jsonl"
    problem = name_problem(name)
    if problem is not None:  # a worker index or file number beyond any real capture's
        raise ValueError(problem)
    return name


@dataclass
class RotatingFiles:
    """One worker's capture files: appended to, a new one past MAX_BYTES, at most KEEP of them."""

    folder: Path
    worker: int
    max_bytes: int
    keep: int
    _fd: int | None = None
    _size: int = 0
    _kept: list[Path] = field(default_factory=list)
    _number: int = 0

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.keep < 1:
            raise ValueError("a capture needs a positive file size and at least one file kept")
        earlier = capture_files(self.folder, self.worker)  # this worker's, before it was started again
        self._kept = [path for _worker, _number, path in earlier]
        self._number = earlier[-1][1] if earlier else 0

    def write(self, data: bytes) -> None:
        """Append DATA (whole lines); OSError when the disk refuses (the file is cut back to whole lines)."""
        if self._fd is None or (self._size and self._size + len(data) > self.max_bytes):
            self._next_file()
        assert self._fd is not None  # noqa: S101 (opened above)
        try:
            self._append(self._fd, data)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    @staticmethod
    def _append(fd: int, data: bytes) -> None:
        written = os.write(fd, data)
        while written < len(data):  # a short write: the disk filled up in the middle
            written += os.write(fd, data[written:])

    def _next_file(self) -> None:
        self.close()
        self._number += 1
        path = child_path(self.folder, file_name(self.worker, self._number))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        self._fd, self._size = os.open(path, flags, FILE_MODE), 0
        self._kept.append(path)
        while len(self._kept) > self.keep:
            self._kept.pop(0).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class CaptureWriter:
    """RotatingFiles fed from a queue by a thread: `put` never waits; a full queue or a stopped capture
    drops the line (counted)."""

    def __init__(self, files: RotatingFiles) -> None:
        self.files = files
        self.dropped = 0
        self.failed = False
        self._queue: queue.Queue[bytes | None] = queue.Queue(MAX_QUEUED_LINES)
        self._thread = threading.Thread(target=self._run, name=f"capture-w{files.worker}", daemon=True)
        self._thread.start()

    def put(self, line: bytes) -> None:
        if self.failed:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            if not self.dropped:
                log.warning("trace capture: the disk is slower than the traffic; lines are being left out")
            self.dropped += 1

    def _run(self) -> None:
        while (line := self._queue.get()) is not None:
            if self.failed:
                continue
            try:
                self.files.write(line)
            except OSError as exc:
                self.failed = True
                log.error(
                    "trace capture into %s stopped: %s; requests are still served, without capture",
                    self.files.folder, exc.strerror or exc,
                )  # fmt: skip
        self.files.close()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then close the file (waiting TIMEOUT_S at most)."""
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):  # a writer stuck on its disk: left behind (a daemon)
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)
        if self.dropped:
            log.warning("trace capture: %d lines were left out (see above)", self.dropped)
