"""Run a command as a slow, busy host would: a busy loop competes for one CPU core (or each core named)
the whole time.

    python -m tests.slow_host [--core N]... [--max-seconds S] -- pytest -m engine ...

vLLM's CPU build runs its compute threads in lock step (OpenMP), so one contended core slows every engine
step, and a verdict that depends on how fast the host serves fails here before it fails on a slower CI
machine. Each busy loop is a process of its own, pinned to one core, ended by its own deadline if this
runner is killed, and stopped by its process group when the command ends. The exit code is the command's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from kvtune.processes import stop_group

# The loop checks its deadline every this many iterations: cheap, and a bound on how late it stops.
BUSY_LOOP = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    for _ in range(100_000):
        pass
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.slow_host", description=__doc__.split("\n")[0])
    allowed = sorted(os.sched_getaffinity(0))
    parser.add_argument(
        "--core",
        type=int,
        action="append",
        help=f"a core to keep busy; repeat it for several (default {allowed[-1]})",
    )
    parser.add_argument(
        "--max-seconds", type=float, default=7200.0, help="the busy loop ends by itself after this long"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the command to run after --")
    args.core = sorted(set(args.core or [allowed[-1]]))
    for core in args.core:
        if core not in allowed:
            parser.error(f"--core {core}: this process may run only on cores {allowed}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", BUSY_LOOP, str(core), str(args.max_seconds)], start_new_session=True
        )
        for core in args.core
    ]
    started = time.monotonic()
    for hog, core in zip(hogs, args.core, strict=True):
        print(f"slow host: a busy loop (pid {hog.pid}) competes for core {core}", file=sys.stderr)
    try:
        return subprocess.call(args.command)
    finally:
        busy_to_the_end = all(hog.poll() is None for hog in hogs)
        for hog in hogs:
            stop_group(hog, grace_s=2)
        elapsed = time.monotonic() - started
        if busy_to_the_end:
            print(f"slow host: busy loops stopped after {elapsed:.0f} s", file=sys.stderr)
        else:  # a deadline (or something else) ended one first: part of the run was not slowed
            print(f"slow host: a busy loop ended before the command ({elapsed:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
