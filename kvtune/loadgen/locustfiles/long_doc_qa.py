"""Long-document Q&A: a few long documents, many short questions about each.

locust -f loadtests/long_doc_qa.py --host http://127.0.0.1:8000 [--num-docs 2 --doc-tokens 3000]
"""

from __future__ import annotations

import argparse

from locust import run_single_user

from kvtune.loadgen.locust_flags import register_workload_flags
from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workloads import LongDocQA, Workload

register_workload_flags("long_doc_qa")


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
