"""A command's own peak memory, measured apart from the test process.

On Linux a child's peak RSS (`ru_maxrss`, from wait4 or RUSAGE_CHILDREN) starts from its parent's at fork and
survives exec: a command started straight from a pytest worker that has imported vLLM reports the worker's
850 MB. So the command is started by a small Python wrapper, whose own children's peak is what it reports
(the command's processes that it, or they, reaped: kvtune reaps Locust, so Locust's peak counts too).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_WRAPPER = """
import json, resource, subprocess, sys
code = subprocess.call(sys.argv[2:])
peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
with open(sys.argv[1], "w") as out:
    json.dump({"code": code, "peak_kib": peak_kib}, out)
sys.exit(code)
"""


def measured(argv: list[str], report: Path) -> list[str]:
    """`argv` run through the wrapper, which writes the exit code and peak RSS to `report` at the end."""
    return [sys.executable, "-c", _WRAPPER, str(report), *argv]


def read_report(report: Path) -> tuple[int, int]:
    """The command's exit code and its peak RSS in bytes, as the wrapper wrote them."""
    measured_run = json.loads(report.read_text())
    return int(measured_run["code"]), int(measured_run["peak_kib"]) * 1024
