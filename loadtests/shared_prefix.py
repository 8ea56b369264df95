"""Shared system prompt: a long fixed system prompt plus a varying user message.

    locust -f loadtests/shared_prefix.py --host http://127.0.0.1:8000 [--system-tokens 800 --user-tokens 400]

The workload ships with kvtune (kvtune.loadgen.locustfiles.shared_prefix); copy this file to start your own.
"""

from __future__ import annotations

from locust import run_single_user

from kvtune.loadgen.locustfiles.shared_prefix import SharedPrefixUser

__all__ = ["SharedPrefixUser"]

if __name__ == "__main__":
    run_single_user(SharedPrefixUser)
