"""Long-document Q&A: a few long documents, many short questions about each.

locust -f loadtests/long_doc_qa.py --host http://127.0.0.1:8000 [--num-docs 2 --doc-tokens 3000]
"""

from __future__ import annotations

import argparse

from locust import events, run_single_user

from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import LongDocQA, Workload


@events.init_command_line_parser.add_listener
def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-docs", env_var="KVTUNE_NUM_DOCS", type=int, default=2, help="documents asked about"
    )
    parser.add_argument(
        "--doc-tokens",
        env_var="KVTUNE_DOC_TOKENS",
        type=int,
        default=3000,
        help="tokens per document (within max_model_len)",
    )
    parser.add_argument(
        "--question-tokens",
        env_var="KVTUNE_QUESTION_TOKENS",
        type=int,
        default=32,
        help="tokens per question",
    )


class LongDocQAUser(LLMUser):
    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        return LongDocQA(
            maker,
            options.num_docs,
            options.doc_tokens,
            options.question_tokens,
            options.max_tokens,
            options.seed,
        )


if __name__ == "__main__":
    run_single_user(LongDocQAUser)
