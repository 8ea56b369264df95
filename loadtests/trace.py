"""Trace: a recorded trace's requests at its own arrival times, once, as a hash-block trace (token-id prompts
sharing what its blocks share) or your own JSONL of prompts or messages with a "timestamp" (ms) per line.

    locust -f loadtests/trace.py --host http://127.0.0.1:8000 --trace-file trace.jsonl [--time-scale 0.5]

The workload ships with kvtune (kvtune.loadgen.locustfiles.trace); copy this file to start your own.
"""

from __future__ import annotations

from locust import run_single_user

from kvtune.loadgen.locustfiles.trace import TraceUser

__all__ = ["TraceUser"]

if __name__ == "__main__":
    run_single_user(TraceUser)
