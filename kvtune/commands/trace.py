"""`kvtune trace`: make, convert, merge and read traces of traffic without its text.

Each action is a module of its own (`trace_<action>.py`) with `add_cli_args(parser)` and `main(args)`; this
module only lists them, imported when chosen.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

# Each action's module and its one-line help.
ACTIONS: dict[str, tuple[str, str]] = {
    "curve": (
        "kvtune.commands.trace_curve",
        "the prefix-cache hit rate of every pool size for a trace, and what each pool costs a profile",
    ),
    "convert": (
        "kvtune.commands.trace_convert",
        "a log of OpenAI-style requests (messages or prompt per line) as a trace without its text",
    ),
    "merge": (
        "kvtune.commands.trace_merge",
        "a capture's files (kvtune up --capture-trace, each router worker's) as one trace in arrival order",
    ),
    "generate": (
        "kvtune.commands.trace_generate",
        "a synthetic multi-turn chat trace, to try kvtune trace without a trace of your own",
    ),
}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="trace_action", metavar="ACTION", required=True)
    for name, (module_name, help_text) in ACTIONS.items():
        sub = actions.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_cli_args(sub)
        sub.set_defaults(trace_handler=module.main)


def main(args: argparse.Namespace) -> int:
    handler: Callable[[argparse.Namespace], int] = args.trace_handler
    return handler(args)
