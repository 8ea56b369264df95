"""A stop asked for by SIGINT or SIGTERM, kept as a flag that long work reads at points where it can stop.

A signal handler runs in the main thread between any two bytecodes. An exception raised there lands
wherever that thread happens to be: between a lock's acquire and its release (Rich's console lock, the
logging module's), and every thread that takes that lock next waits forever. Even `threading.Event.set()`
takes a lock (its condition's), one the main thread itself holds while inside `Event.wait()`. So the
handler here only stores the signal's number: no lock, no I/O, nothing that can be half done. Whoever
runs the work reads the flag where stopping is safe, and ends the processes it waits on (processes.py).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Protocol

SignalHandler = Callable[[int, FrameType | None], None]
# How often a waiting StopRequest looks at its flag.
_POLL_S = 0.1


class StopFlag(Protocol):
    """What long work reads: `threading.Event` has this shape, and so does `StopRequest`."""

    def is_set(self) -> bool: ...


class StopRequest:
    """Set from a signal handler without taking a lock; read from any thread."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def set(self, signum: int = signal.SIGTERM) -> None:
        self.signum = signum  # one store of a reference: atomic, whatever the main thread was doing

    def is_set(self) -> bool:
        return self.signum is not None

    def wait(self, seconds: float) -> bool:
        """Sleep up to SECONDS, waking within a tenth of a second of a stop; True when one was asked.

        A polled sleep, not `threading.Event.wait`: the handler must not take the lock such a wait holds."""
        deadline = time.monotonic() + seconds
        while not self.is_set() and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_POLL_S, left))
        return self.is_set()

    def describe(self) -> str:
        """How the stop was asked for, for a user: "Ctrl-C" or the signal's name."""
        if self.signum is None:
            return "not asked"
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name


@contextmanager
def signals_handled_by(handler: SignalHandler) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` inside, and back to what they were after.

    SIGINT is set explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT ignored, and `kill -INT` would then do nothing. Outside the main thread (where Python refuses
    to install handlers) nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def requested_by_signals() -> Iterator[StopRequest]:
    """SIGINT and SIGTERM set the yielded request inside (and raise nothing)."""
    request = StopRequest()
    with signals_handled_by(lambda signum, _frame: request.set(signum)):
        yield request
