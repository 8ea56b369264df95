"""Replay: your own prompts from JSONL ({"messages": [...]} or {"prompt": ...} per line), in order.

    locust -f loadtests/replay.py --host http://127.0.0.1:8000 --replay-file prompts.jsonl

The workload ships with kvtune (kvtune.loadgen.locustfiles.replay); copy this file to start your own.
"""

from __future__ import annotations

from locust import run_single_user

from kvtune.loadgen.locustfiles.replay import ReplayUser

__all__ = ["ReplayUser"]

if __name__ == "__main__":
    run_single_user(ReplayUser)
