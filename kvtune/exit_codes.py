"""kvtune's exit codes: a contract with scripts and CI, in one place any module may import."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILED = 1  # the work ran and failed (an engine died for good, a request failed)
    CONFIG = 2  # bad input: nothing was started
    INTERRUPTED = 130  # Ctrl-C
