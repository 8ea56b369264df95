"""Shared system prompt: a long fixed system prompt plus a varying user message.

locust -f loadtests/shared_prefix.py --host http://127.0.0.1:8000 [--system-tokens 800 --user-tokens 400]
[--prefix-reuse 0.67]   (target share of prompt tokens a prefix cache can reuse; default: the system prompt)
"""

from __future__ import annotations

import argparse

from locust import run_single_user

from kvtune.loadgen.locust_flags import register_workload_flags
from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import SharedPrefix, Workload

register_workload_flags("shared_prefix")


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
