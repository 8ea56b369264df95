"""The Locust files kvtune ships, one per workload plus a step load shape, for `locust -f` and the runner.

Importing this package does not import Locust (which patches the whole process for gevent).
"""

from __future__ import annotations

from pathlib import Path

LOCUSTFILES = Path(__file__).resolve().parent


def locustfile(name: str) -> Path:
    """The file `locust -f` runs for a workload or load shape, e.g. `shared_prefix` or `step_shape`."""
    return LOCUSTFILES / f"{name}.py"
