"""Trace: a recorded trace's requests at the trace's own arrival times, in its order, once.

A hash-block trace (timestamp, input_length, output_length, hash_ids per line) is sent as token-id prompts
that share what the trace's blocks share; a JSONL of prompts or chat messages keeps its text, paced by an
optional "timestamp" (ms) per line. The test ends when the trace's requests are answered.

    locust -f loadtests/trace.py --host http://127.0.0.1:8000 --trace-file trace.jsonl [--time-scale 0.5]
"""

from __future__ import annotations

import argparse
import logging

from locust import run_single_user

from kvtune.loadgen.locust_flags import register_workload_flags
from kvtune.loadgen.locust_user import LLMUser
from kvtune.loadgen.text import TextMaker, vocab_size
from kvtune.loadgen.trace_workload import EngineFacts, TraceArgs, build_trace_workload
from kvtune.loadgen.workload_args import WORKLOAD_ARGS
from kvtune.loadgen.workloads import Workload

log = logging.getLogger(__name__)

register_workload_flags("trace")


class TraceUser(LLMUser):
    reads_block_size = True

    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        given = {
            arg.flag: value
            for arg in WORKLOAD_ARGS["trace"]
            if (value := getattr(options, arg.dest)) is not None and value != arg.default
        }
        model = cls._model
        engine = EngineFacts(
            model.block_size if model else None,
            model.max_model_len if model else None,
            vocab_size(maker.tokenizer),
        )
        workload = build_trace_workload(
            TraceArgs.of(given, options.seed), engine, options.arrival, options.max_tokens, options.seed
        )
        if workload.cuts.requests:
            log.warning(
                "%d of %d trace requests cut to fit the engine's max_model_len %s: %d prompt and %d output "
                "tokens",
                workload.cuts.requests,
                len(workload),
                engine.max_model_len,
                workload.cuts.prompt_tokens,
                workload.cuts.output_tokens,
            )
        return workload


if __name__ == "__main__":
    run_single_user(TraceUser)
