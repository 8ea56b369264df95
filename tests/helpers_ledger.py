"""The engine-start ledger of a test session: where tests/engine_ledger/sitecustomize.py writes one line per
vLLM server started, and the summary `make test` prints of it (per test file, per configuration)."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# The folder whose sitecustomize.py records each vLLM server start, and the variable naming the ledger file.
LEDGER_SITE = Path(__file__).resolve().parent / "engine_ledger"
LEDGER_ENV = "KVTUNE_TEST_ENGINE_LEDGER"
OUTSIDE_A_TEST = "(no test running)"
_ENDPOINT_PORT = re.compile(r"(tcp://[^:\"]+):\d+")


@dataclass(frozen=True)
class EngineStart:
    """One line of the ledger: when a vLLM server started, under which test, with which flags."""

    time: float
    test: str  # PYTEST_CURRENT_TEST as the server inherited it: "tests/test_x.py::test_y (setup)"
    flags: tuple[str, ...]  # its argv after the module name

    @property
    def test_file(self) -> str:
        return self.test.split("::", 1)[0] if self.test else OUTSIDE_A_TEST

    @property
    def configuration(self) -> str:
        """The flags that decide what the engine is: less its ports (free ones, new each start) and with the
        model's folder by its name (a temporary folder's path differs per session)."""
        words: list[str] = []
        flags = iter(self.flags)
        for flag in flags:
            if flag == "--port":
                next(flags, None)
                continue
            words.append(flag)
            if flag == "--model":
                words.append(Path(next(flags, "")).name)
            elif flag == "--kv-events-config":
                words.append(_ENDPOINT_PORT.sub(r"\1:PORT", next(flags, "")))
        return " ".join(words)


def enable(ledger: Path) -> Path:
    """Record the engine starts of this process's children in LEDGER, or in the ledger a parent named already
    (pytest-xdist's workers write to their controller's); returns the ledger in use."""
    in_use = os.environ.setdefault(LEDGER_ENV, str(ledger))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(LEDGER_SITE) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(LEDGER_SITE), *filter(None, paths)])
    return Path(in_use)


def read_ledger(ledger: Path) -> list[EngineStart]:
    """The starts LEDGER holds, oldest first; a line cut short (a process killed mid-write) is skipped."""
    try:
        text = ledger.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    starts = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
            starts.append(EngineStart(float(record["time"]), str(record["test"]), tuple(record["flags"])))
        except (ValueError, KeyError, TypeError):
            continue
    return sorted(starts, key=lambda start: start.time)


def format_duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{rest}s"


def summary_lines(starts: list[EngineStart], wall_s: float) -> list[str]:
    """What the session's end prints: engine starts in total, per test file, per configuration, and the
    session's wall time."""
    lines = [f"{len(starts)} engine starts; session wall time {format_duration(wall_s)}"]
    for title, counts in (
        ("per test file", Counter(start.test_file for start in starts)),
        ("per configuration (flags less ports)", Counter(start.configuration for start in starts)),
    ):
        if counts:
            lines.append(f"{title}:")
            lines += [f"  {count:3d}  {name}" for name, count in counts.most_common()]
    return lines
