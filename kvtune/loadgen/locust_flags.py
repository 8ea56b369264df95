"""kvtune's flags on Locust's command line: the ones every kvtune Locust file has, and a workload's own.

Locust collects flags through its `init_command_line_parser` event, whose listeners must be registered
before it parses the command line: the common flags are registered when this module is imported (every
Locust file imports it through kvtune.loadgen.locust_user), a workload's when its Locust file calls
`register_workload_flags`.
"""

from __future__ import annotations

import argparse

from locust import events

from kvtune.loadgen.pacing import ARRIVALS
from kvtune.loadgen.workload_args import (
    API_KEY_ENV,
    DEFAULT_ARRIVAL,
    DEFAULT_MAX_TOKENS,
    WORKLOAD_ARGS,
    WorkloadArg,
    add_arguments,
)


@events.init_command_line_parser.add_listener
def _common_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "kvtune", f"An API key for the engine is read from the environment variable {API_KEY_ENV} only."
    )
    group.add_argument(
        "--model",
        env_var="KVTUNE_MODEL",
        default="",
        help="served model name (default: the first the server lists)",
    )
    group.add_argument(
        "--tokenizer",
        env_var="KVTUNE_TOKENIZER",
        default="",
        help="tokenizer folder or hub id (default: the server's model)",
    )
    group.add_argument(
        "--tokenizer-revision",
        env_var="KVTUNE_TOKENIZER_REVISION",
        default="",
        help="the hub revision of --tokenizer (the engine's pinned model revision); default: the main branch",
    )
    group.add_argument(
        "--max-tokens",
        env_var="KVTUNE_MAX_TOKENS",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="output tokens per request (default: %(default)s)",
    )
    group.add_argument(
        "--ignore-eos",
        env_var="KVTUNE_IGNORE_EOS",
        action="store_true",
        help="always generate --max-tokens tokens",
    )
    group.add_argument(
        "--arrival",
        env_var="KVTUNE_ARRIVAL",
        choices=ARRIVALS,
        default="closed",
        help="closed: each user waits for its answer; constant/poisson: open loop at --arrival-rate; trace: "
        "open loop at a trace's own times (loadtests/trace.py's default)",
    )
    group.add_argument(
        "--arrival-rate",
        env_var="KVTUNE_ARRIVAL_RATE",
        type=float,
        default=1.0,
        help="open-loop requests per second",
    )
    group.add_argument(
        "--samples-file",
        env_var="KVTUNE_SAMPLES_FILE",
        default="",
        help="write one JSON line per request here",
    )
    group.add_argument(
        "--seed", env_var="KVTUNE_SEED", type=int, default=0, help="seed of generated prompts and arrivals"
    )
    group.add_argument(
        "--request-timeout",
        env_var="KVTUNE_REQUEST_TIMEOUT",
        type=float,
        default=600.0,
        help="seconds before a request fails",
    )
    group.add_argument(
        "--finish-within",
        env_var="KVTUNE_FINISH_WITHIN",
        type=float,
        default=0.0,
        help="with --run-for: requests still running this many seconds after it fail (0: no such bound)",
    )
    group.add_argument(
        "--run-for",
        env_var="KVTUNE_RUN_FOR",
        type=float,
        default=0.0,
        help="seconds after the test starts when users stop sending and finish what is in flight",
    )


_REGISTERED: set[str] = set()


def register_flags(title: str, definitions: tuple[WorkloadArg, ...]) -> None:
    """Register flags declared in kvtune.loadgen.workload_args on Locust's command line, once.

    Once: Locust imports a `-f` file under its file name, so the same file given twice (or as a copy
    in loadtests/ and by its package path) must not declare its flags twice.
    """
    if title in _REGISTERED:
        return
    _REGISTERED.add(title)

    def _arguments(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser.add_argument_group(title), definitions)

    events.init_command_line_parser.add_listener(_arguments)


def register_workload_flags(workload: str) -> None:
    """A workload's own flags, and its own default --arrival (a trace arrives at its own times)."""
    register_flags(workload, WORKLOAD_ARGS[workload])
    if workload in DEFAULT_ARRIVAL and f"{workload} arrival" not in _REGISTERED:
        _REGISTERED.add(f"{workload} arrival")

        def _arrival(parser: argparse.ArgumentParser) -> None:
            parser.set_defaults(arrival=DEFAULT_ARRIVAL[workload])

        events.init_command_line_parser.add_listener(_arrival)
