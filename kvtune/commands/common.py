"""What subcommands share: exit codes and loading profiles."""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

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
