"""Multi-turn chat: conversations that grow turn by turn, each turn resending the history.

    locust -f loadtests/multi_turn.py --host http://127.0.0.1:8000 [--turns 4 --turn-tokens 200]

The workload ships with kvtune (kvtune.loadgen.locustfiles.multi_turn); copy this file to start your own.
"""

from __future__ import annotations

from locust import run_single_user

from kvtune.loadgen.locustfiles.multi_turn import MultiTurnUser

__all__ = ["MultiTurnUser"]

if __name__ == "__main__":
    run_single_user(MultiTurnUser)
