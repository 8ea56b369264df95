"""The per-request samples kvtune's Locust users write (one JSON object a line), read back with bounds.

The files are kvtune's own, but they sit in a folder anyone may write to (a temp dir, a `--log-dir`), and a
damaged one must not cost the run its memory or its message: each file is a regular file of bounded size,
each line is bounded, and anything else is one DocumentError naming the file (and the line). The one line
allowed to be broken is the last: a Locust process stopped mid-write leaves half a line there.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtune.config_errors import DocumentError
from kvtune.documents import open_regular

log = logging.getLogger(__name__)

KIND = "a Locust samples file kvtune wrote"
# A sample holds one inter-token gap per generated token, ~22 bytes each: 2.9 MB at 131,072 tokens, the most
# `kvtune load --max-tokens` takes (workload_args.MOST_MAX_TOKENS). A line past this is not a sample.
MAX_LINE_BYTES = 4 * 1024 * 1024
# A sample of a 256-token answer is ~6 KB: an hour at 50 req/s writes ~1 GB. Everything read is held in
# memory (the window's summary needs every latency), so a file past this is refused, not read.
MAX_FILE_BYTES = 2 * 1024**3
_CHUNK = 1 << 20


def _refuse(path: Path, problem: str) -> DocumentError:
    return DocumentError(f"{path}: {problem}", path=path, summary=problem)


def _check_size(path: Path, size: int) -> None:
    if size > MAX_FILE_BYTES:
        raise _refuse(
            path,
            f"is {size / 2**30:.1f} GiB, larger than the {MAX_FILE_BYTES / 2**30:g} GiB kvtune reads as "
            "a samples file; shorten the run or split it into several",
        )


def _lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """(line number, line without its newline, whether it ended in one) of a bounded file."""
    with open_regular(path, KIND) as file:
        _check_size(path, os.fstat(file.fileno()).st_size)
        read = 0
        for number in range(1, 1 << 62):
            line = file.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            read += len(line)
            if len(line) > MAX_LINE_BYTES:
                raise _refuse(
                    path, f"line {number} is longer than {MAX_LINE_BYTES / 2**20:g} MiB; it is not a sample"
                )
            _check_size(path, read)  # it grew while being read
            ended = line.endswith(b"\n")
            yield number, line.rstrip(b"\n"), ended


def read_samples(path: Path, *, while_written: bool = False) -> list[dict[str, Any]]:
    """Every sample of one file, in order. A last line with no newline that is not JSON (being written, or
    cut by a stop) is skipped, with a warning unless WHILE_WRITTEN (then it is expected); any other line
    that is not a JSON object is a DocumentError naming it."""
    records: list[dict[str, Any]] = []
    for number, line, ended in _lines(path):
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif not ended:
            if not while_written:
                log.warning("skipped a partly written sample at the end of %s", path)
        elif line.strip():
            raise _refuse(path, f"line {number} is not a sample (a JSON object); the file is damaged")
    return records


def count_lines(path: Path) -> int:
    """How many samples a file holds so far (its newlines), read in chunks of bounded size."""
    lines = 0
    with open_regular(path, KIND) as file:
        _check_size(path, os.fstat(file.fileno()).st_size)
        while chunk := file.read(_CHUNK):
            lines += chunk.count(b"\n")
    return lines
