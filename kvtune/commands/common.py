"""What subcommands share: exit codes, the flags several of them take, loading profiles, the types of numeric
flags, signals."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from kvtune.exit_codes import ExitCode as ExitCode  # re-exported: the subcommands take it from here
from kvtune.profile import EngineProfile, load_profile
from kvtune.stop_request import requested_by_signals, signals_handled_by

# A flag in seconds beyond a week is a typo (or `inf`): no step, scrape or timeout of kvtune's is that long.
LONGEST_FLAG_SECONDS = 7 * 86400


def port_number(text: str) -> int:
    """argparse type of a TCP port flag: 1-65535 (a port past 65535 would fail deep inside the start)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a port number; give 1-65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number; give 1-65535")
    return port


def seconds_at_most(most: float, said: str = "") -> Callable[[str], float]:
    """argparse type of a duration flag: a finite number of seconds, above zero and at most MOST (SAID
    names that bound in words)."""
    bound = f"{most:,g}" + (f" ({said})" if said else "")

    def duration(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
        if not (math.isfinite(value) and 0 < value <= most):
            raise argparse.ArgumentTypeError(
                f"{text[:40]} is not a usable number of seconds; give one above 0 and at most {bound}"
            )
        return value

    return duration


# The type of most duration flags: at most a week, longer is a typo.
seconds = seconds_at_most(LONGEST_FLAG_SECONDS, "a week")


def count(text: str, least: int = 0) -> int:
    """argparse type of a count flag (restarts): a whole number, `least` or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is below {least}; give {least} or more")
    return value


def positive_count(text: str) -> int:
    """argparse type of a count that must be 1 or more (tokens to generate)."""
    return count(text, least=1)


def whole_number_between(least: int, most: int) -> Callable[[str], int]:
    """argparse type of a count flag with an upper bound too (processes to start): LEAST to MOST."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{value} is out of range; give {least:,} to {most:,}")
        return value

    return whole


def number_between(
    least: float, most: float, unit: str = "", *, above: bool = False
) -> Callable[[str], float]:
    """argparse type of a finite number from LEAST (or ABOVE it) to MOST, in UNIT (a size, a factor): the
    bounds say what works, so a value past them is refused instead of being rounded into a silent limit."""
    unit = f" {unit}" if unit else ""
    said = (
        f"give one above {least:,g}{unit} and at most {most:,g}{unit}"
        if above
        else f"give {least:,g} to {most:,g}{unit}"
    )

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number; {said}") from None
        low_ok = value > least if above else value >= least
        if not (math.isfinite(value) and low_ok and value <= most):
            raise argparse.ArgumentTypeError(f"{text[:40]} is out of range; {said}")
        return value

    return number


def positive_number(text: str) -> float:
    """argparse type of a finite factor above zero (a load factor)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text[:40]} is not a finite number above 0")
    return value


# ---- flags several subcommands take, declared once so their names, defaults and help cannot drift ----------

# argparse's parsers and argument groups both take add_argument (its common base is private).
Flags = argparse.ArgumentParser | argparse._ArgumentGroup


def add_profile_argument(parser: Flags) -> None:
    parser.add_argument("profile", type=Path, metavar="PROFILE", help="engine profile YAML")


def add_cache_dir_flag(parser: Flags) -> None:
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="model cache folder (default: $KVTUNE_CACHE_DIR, else the user cache dir for kvtune)",
    )


def add_log_dir_flag(parser: Flags) -> None:
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=Path("kvtune-logs"),
        help="where each engine's log goes (default ./%(default)s)",
    )


def add_ttft_slo_flag(parser: Flags, *, default: float | None, help_text: str) -> None:
    """`--ttft-slo SECONDS`, the P99 time-to-first-token SLO of the alert rule; HELP_TEXT says what it sets
    for this subcommand."""
    parser.add_argument("--ttft-slo", type=seconds, default=default, metavar="SECONDS", help=help_text)


def load_profiles(paths: list[Path]) -> list[tuple[EngineProfile, str | None]]:
    """Load every profile as this host will run it, with a note where it had to adapt.

    Raises ConfigError naming the file and field of the first bad one.
    """
    return [load_profile(path).adapted_to_host() for path in paths]


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def interrupted_by_signals() -> Iterator[None]:
    """SIGINT and SIGTERM both raise KeyboardInterrupt inside, so long work stops through one clean path.

    Only for work whose every step may be cut anywhere; work that holds locks (a progress bar, logging)
    reads a flag instead: `stop_requested_by_signals`."""
    with signals_handled_by(_interrupt):
        yield


# SIGINT and SIGTERM set the yielded request instead of raising, for loops that wait between short steps:
# the step in hand finishes and the loop ends at its next wait (kvtune/stop_request.py says why).
stop_requested_by_signals = requested_by_signals
