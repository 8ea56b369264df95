"""Long-document Q&A: a few long documents, many short questions about each.

    locust -f loadtests/long_doc_qa.py --host http://127.0.0.1:8000 [--num-docs 2 --doc-tokens 3000]

The workload ships with kvtune (kvtune.loadgen.locustfiles.long_doc_qa); copy this file to start your own.
"""

from __future__ import annotations

from locust import run_single_user

from kvtune.loadgen.locustfiles.long_doc_qa import LongDocQAUser

__all__ = ["LongDocQAUser"]

if __name__ == "__main__":
    run_single_user(LongDocQAUser)
