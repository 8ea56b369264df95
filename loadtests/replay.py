"""Replay: a user's own prompts from JSONL, one request per line, in order and round again.

Each line is {"messages": [{"role": ..., "content": ...}, ...]} or {"prompt": "..."}, optionally "max_tokens".

    locust -f loadtests/replay.py --host http://127.0.0.1:8000 --replay-file prompts.jsonl
"""

from __future__ import annotations

import argparse
from pathlib import Path

from locust import events, run_single_user

from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import Replay, Workload, WorkloadError


@events.init_command_line_parser.add_listener
def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replay-file",
        env_var="KVTUNE_REPLAY_FILE",
        default="",
        help="JSONL file of prompts or chat messages",
    )


class ReplayUser(LLMUser):
    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        if not options.replay_file:
            raise WorkloadError("no replay file given; pass --replay-file PATH (JSONL)")
        return Replay(Path(options.replay_file), options.max_tokens)


if __name__ == "__main__":
    run_single_user(ReplayUser)
