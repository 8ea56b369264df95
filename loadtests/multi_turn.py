"""Multi-turn chat: conversations that grow turn by turn, each turn resending the history.

locust -f loadtests/multi_turn.py --host http://127.0.0.1:8000 [--turns 4 --turn-tokens 200]
"""

from __future__ import annotations

import argparse

from locust import events, run_single_user

from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import MultiTurn, Workload


@events.init_command_line_parser.add_listener
def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", env_var="KVTUNE_TURNS", type=int, default=4, help="turns per conversation")
    parser.add_argument(
        "--turn-tokens", env_var="KVTUNE_TURN_TOKENS", type=int, default=200, help="tokens of each user turn"
    )


class MultiTurnUser(LLMUser):
    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        return MultiTurn(maker, options.turns, options.turn_tokens, options.max_tokens, options.seed)


if __name__ == "__main__":
    run_single_user(MultiTurnUser)
