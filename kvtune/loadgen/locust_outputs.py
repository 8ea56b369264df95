"""The end-of-run TTFT and ITL figures: a log line per row, `PREFIX_token_latency.csv` with
`--csv PREFIX` and `NAME_token_latency.json` with `--json-file NAME`, beside Locust's own files.

The listeners are registered when this module is imported (every Locust file imports it through
kvtune.loadgen.locust_user).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from locust import events
from locust.env import Environment
from locust.runners import WorkerRunner

from kvtune.loadgen.locust_token_stats import TOKEN_STATS, token_csv, token_rows

log = logging.getLogger(__name__)

# Environment of this process, for the end-of-run outputs (Locust's `quit` event carries none).
_ENVIRONMENT: list[Environment] = []


@events.init.add_listener
def _remember_environment(environment: Environment, **_kwargs: Any) -> None:
    _ENVIRONMENT[:] = [environment]


@events.quit.add_listener
def _write_token_latency(**_kwargs: Any) -> None:
    """After Locust's own summary and files: the same figures for TTFT and ITL."""
    environment = _ENVIRONMENT[0] if _ENVIRONMENT else None
    if environment is None or isinstance(environment.runner, WorkerRunner):
        return
    for row in token_rows(TOKEN_STATS):
        log.info(
            "%s %s: %d samples, median %s ms, p90 %s ms, p99 %s ms, max %s ms",
            *(row[key] for key in ("method", "name", "samples", "median", "p90", "p99", "max")),
        )
    options = environment.parsed_options
    if options is not None and getattr(options, "csv_prefix", None):
        Path(f"{options.csv_prefix}_token_latency.csv").write_text(token_csv(TOKEN_STATS))
    if options is not None and getattr(options, "json_file", None):
        Path(f"{options.json_file}_token_latency.json").write_text(
            json.dumps(token_rows(TOKEN_STATS), indent=2)
        )
