"""Multi-turn chat: conversations that grow turn by turn, each turn resending the history.

locust -f loadtests/multi_turn.py --host http://127.0.0.1:8000 [--turns 4 --turn-tokens 200]
"""

from __future__ import annotations

import argparse

from locust import run_single_user

from kvtune.loadgen.locust_flags import register_workload_flags
from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import MultiTurn, Workload

register_workload_flags("multi_turn")


class MultiTurnUser(LLMUser):
    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        return MultiTurn(maker, options.turns, options.turn_tokens, options.max_tokens, options.seed)


if __name__ == "__main__":
    run_single_user(MultiTurnUser)
