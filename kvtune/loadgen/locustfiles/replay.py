"""Replay: a user's own prompts from JSONL, one request per line, in order and round again.

Each line is {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": "..."}, optionally "max_tokens".

    locust -f loadtests/replay.py --host http://127.0.0.1:8000 --replay-file prompts.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from locust import run_single_user

from kvtune.loadgen.locust_flags import register_workload_flags
from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workload_args import validate_workload_args
from kvtune.loadgen.workloads import Replay, Workload

register_workload_flags("replay")


class ReplayUser(LLMUser):
    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        given = {"replay-file": options.replay_file} if options.replay_file else {}
        validate_workload_args("replay", given)  # the flag is required: say so the way a sweep spec does
        return Replay(Path(options.replay_file), options.max_tokens)


if __name__ == "__main__":
    run_single_user(ReplayUser)
