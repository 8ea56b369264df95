"""`kvtune trace merge DIR -o OUT`: a capture's files as one trace in arrival order.

Each router process of a capture writes its own files, rotated (kvtune/router/capture_files.py), each in
arrival order with every worker's times from the capture's one origin; so the whole is a k-way merge by
timestamp (heapq.merge), each file read strictly first (kvtune/traces/format.py).
"""

from __future__ import annotations

import argparse
import heapq
import io
from pathlib import Path

from rich.console import Console

from kvtune.commands.common import ExitCode
from kvtune.config_errors import ConfigError
from kvtune.files import output_file_problem, write_atomic
from kvtune.router.capture_files import FILE_GLOB, capture_files
from kvtune.traces.format import MAX_REQUESTS, Trace, TraceError, read_trace, write_trace

console = Console(stderr=True, soft_wrap=True)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "sources",
        nargs="+",
        type=Path,
        metavar="DIR",
        help=f"a capture folder (its {FILE_GLOB} files), or trace files of one capture",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUT", help="the trace to write")


def trace_files(sources: list[Path]) -> list[Path]:
    """The files SOURCES name: a folder's capture files (oldest first), a file as it is."""
    files: list[Path] = []
    for source in sources:
        if source.is_dir():
            found = [path for _worker, _number, path in capture_files(source)]
            if not found:
                raise ConfigError(f"{source}: holds no capture files ({FILE_GLOB}); is it a capture folder?")
            files.extend(found)
        else:
            files.append(source)
    return files


def merge(traces: list[Trace]) -> Trace:
    """One trace of TRACES (each in arrival order, one block size) in arrival order."""
    sizes = {trace.block_size for trace in traces}
    if len(sizes) > 1:
        named = ", ".join(f"{trace.source} ({trace.block_size})" for trace in traces)
        raise TraceError(f"the traces have different block sizes: {named}; merge only one capture's files")
    if sum(len(trace.requests) for trace in traces) > MAX_REQUESTS:
        raise TraceError(f"together the traces hold more than {MAX_REQUESTS:,} requests; merge fewer files")
    merged = heapq.merge(*(trace.requests for trace in traces), key=lambda request: request.timestamp_ms)
    return Trace(sizes.pop(), tuple(merged), "the merged trace")


def main(args: argparse.Namespace) -> int:
    problem = output_file_problem(args.output)
    if problem is not None:
        raise ConfigError(f"-o {args.output}: {problem}")
    files = trace_files(args.sources)
    if any(path.resolve() == args.output.resolve() for path in files):
        raise ConfigError(f"-o {args.output}: is one of the files merged; write the trace elsewhere")
    merged = merge([read_trace(path) for path in files])
    text = io.StringIO()
    write_trace(text, merged.requests, merged.block_size)
    write_atomic(args.output, text.getvalue())
    console.print(
        f"Merged {len(merged.requests):,} requests from {len(files)} files into {args.output} "
        f"({merged.duration_ms / 1000:,.1f} s of traffic, blocks of {merged.block_size} tokens)",
        highlight=False,
    )
    return ExitCode.OK
