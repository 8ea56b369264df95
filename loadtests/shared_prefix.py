"""Shared system prompt: a long fixed system prompt plus a varying user message.

locust -f loadtests/shared_prefix.py --host http://127.0.0.1:8000 [--system-tokens 800 --user-tokens 400]
[--prefix-reuse 0.67]   (target share of prompt tokens a prefix cache can reuse; default: the system prompt)
"""

from __future__ import annotations

import argparse

from locust import events, run_single_user

from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import SharedPrefix, Workload


@events.init_command_line_parser.add_listener
def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--system-tokens",
        env_var="KVTUNE_SYSTEM_TOKENS",
        type=int,
        default=800,
        help="tokens of the shared system prompt",
    )
    parser.add_argument(
        "--user-tokens",
        env_var="KVTUNE_USER_TOKENS",
        type=int,
        default=400,
        help="tokens of each user message",
    )
    parser.add_argument(
        "--prefix-reuse",
        env_var="KVTUNE_PREFIX_REUSE",
        type=float,
        default=None,
        help="target share of prompt tokens shared by all requests (0-1)",
    )


class SharedPrefixUser(LLMUser):
    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        return SharedPrefix(
            maker,
            options.system_tokens,
            options.user_tokens,
            options.prefix_reuse,
            options.max_tokens,
            options.seed,
        )


if __name__ == "__main__":
    run_single_user(SharedPrefixUser)
