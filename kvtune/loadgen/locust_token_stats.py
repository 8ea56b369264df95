"""TTFT and ITL statistics of a Locust run, kept apart from Locust's request statistics.

Only the POST requests are Locust request events, so the web UI header's RPS and failure rate, the
Aggregated row and `--csv`'s `_stats.csv` count requests. TTFT and ITL (the gap between content chunks)
time tokens, not requests: they are kept here in statistics of their own (`TOKEN_STATS`), aggregated from
workers like Locust's, and shown as the same rows in the web UI's tab (locust_webui.py) and in the files
and log lines written at the end of a run (locust_outputs.py).
"""

from __future__ import annotations

import csv
import io
from typing import Any

from locust import events
from locust.stats import RequestStats, StatsEntry

TTFT = "TTFT"
ITL = "ITL"

TOKEN_STATS = RequestStats()
_LATENCY_REPORT = "kvtune_token_stats"
TOKEN_COLUMNS = {
    "method": "Type",
    "name": "Name",
    "samples": "Samples",
    "median": "Median (ms)",
    "p90": "90%ile (ms)",
    "p99": "99%ile (ms)",
    "average": "Average (ms)",
    "min": "Min (ms)",
    "max": "Max (ms)",
}


def token_rows(stats: RequestStats) -> list[dict[str, str | int | float]]:
    """One row per (type, name) with samples: the TTFT / ITL tab, CSV and JSON all show these."""
    entries = sorted(stats.entries.values(), key=lambda e: (e.method, e.name))
    return [
        {
            "method": entry.method,
            "name": entry.name,
            "samples": entry.num_requests,
            "median": round(entry.median_response_time, 1),
            "p90": entry.get_response_time_percentile(0.90),
            "p99": entry.get_response_time_percentile(0.99),
            "average": round(entry.avg_response_time, 1),
            "min": round(entry.min_response_time or 0),
            "max": round(entry.max_response_time),
        }
        for entry in entries
        if entry.num_requests
    ]


def token_csv(stats: RequestStats) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(TOKEN_COLUMNS.values()))
    writer.writeheader()
    for row in token_rows(stats):
        writer.writerow({TOKEN_COLUMNS[key]: value for key, value in row.items()})
    return out.getvalue()


@events.test_start.add_listener
def _clear_token_stats(**_kwargs: Any) -> None:
    TOKEN_STATS.clear_all()


@events.reset_stats.add_listener
def _reset_token_stats(**_kwargs: Any) -> None:
    TOKEN_STATS.reset_all()


@events.report_to_master.add_listener
def _send_token_stats(data: dict[str, Any], **_kwargs: Any) -> None:
    data[_LATENCY_REPORT] = TOKEN_STATS.serialize_stats()  # each report carries what is new since the last


@events.worker_report.add_listener
def _receive_token_stats(data: dict[str, Any], **_kwargs: Any) -> None:
    for item in data.get(_LATENCY_REPORT, []):
        entry = StatsEntry.unserialize(item, TOKEN_STATS)
        TOKEN_STATS.entries[(entry.name, entry.method)].extend(entry)
