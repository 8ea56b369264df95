"""What subcommands share: exit codes and loading profiles."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path
from types import FrameType

from kvtune.profile import EngineProfile, load_profile


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the work ran and failed (an engine died for good, a request failed)
    CONFIG = 2  # bad input: nothing was started
    INTERRUPTED = 130  # Ctrl-C


def load_profiles(paths: list[Path]) -> list[tuple[EngineProfile, str | None]]:
    """Load every profile as this host will run it, with a note where it had to adapt.

    Raises ConfigError naming the file and field of the first bad one.
    """
    return [load_profile(path).adapted_to_host() for path in paths]


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def _signals_handled_by(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` inside, and back to what they were after.

    SIGINT is set explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT ignored, and `kill -INT` would then do nothing.
    """
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def interrupted_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM both raise KeyboardInterrupt inside, so long work stops through one clean path."""
    with _signals_handled_by(_interrupt):
        yield


@contextmanager
def stop_requested_by_signals() -> Iterator[threading.Event]:
    """SIGINT and SIGTERM set the yielded event instead of raising, for loops that wait between short steps.

    An exception raised by a signal lands wherever the main thread happens to be: inside an HTTP read, or
    between a lock's acquire and its release in a progress bar, whose refresh thread then waits forever.
    Setting an event lets the step in hand finish and the loop end at its next wait.
    """
    stop = threading.Event()
    with _signals_handled_by(lambda _signum, _frame: stop.set()):
        yield stop
