"""The `kvtune` command: parses arguments and hands each subcommand to its module."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from kvtune import __version__
from kvtune.config_errors import ConfigError
from kvtune.exit_codes import ExitCode

# Each subcommand's module, imported only when that subcommand runs: together they pull in scipy, FastAPI,
# Locust and grafana-client, seconds of start-up that `kvtune doctor` or `kvtune render` never use.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("kvtune.commands.up", "launch and supervise vLLM engines from profiles"),
    "render": ("kvtune.commands.render", "print the vLLM command line and serve YAML of a profile"),
    "ask": ("kvtune.commands.ask", "start a profile's engine, ask one question, stop it"),
    "load": (
        "kvtune.commands.load",
        "run a workload against a running engine; print TTFT, ITL and the engine's view",
    ),
    "sweep": (
        "kvtune.commands.sweep",
        "search engine configs under load against a latency SLO; write the winner",
    ),
    "plan": ("kvtune.commands.plan", "replicas, GPUs and autoscaling for a peak rate, from a sweep's winner"),
    "dashboards": (
        "kvtune.commands.dashboards",
        "build kvtune's Grafana dashboards, or push them to a Grafana",
    ),
    "alerts": ("kvtune.commands.alerts", "print kvtune's Prometheus alert rules at a chosen TTFT SLO"),
    "doctor": ("kvtune.commands.doctor", "read a running engine's counters over a window and diagnose it"),
    "model": ("kvtune.commands.model", "manage the embedded default model"),
    "trace": (
        "kvtune.commands.trace",
        "traces of traffic without its text: the hit rate of every pool size, convert, capture, generate",
    ),
}


def _chosen(argv: Sequence[str] | None) -> str | None:
    """The subcommand ARGV names (its first word that is not an option; "" for none, as in `kvtune
    --help`), or None without ARGV: then every subcommand is built."""
    if argv is None:
        return None
    return next((word for word in argv if not word.startswith("-")), "")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ARGV, only the subcommand it names has its flags (and module) loaded."""
    parser = argparse.ArgumentParser(
        prog="kvtune", description="Deploy and tune vLLM engines: KV budget, prefix caching, fp8 KV cache."
    )
    parser.add_argument("--version", action="version", version=f"kvtune {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen(argv)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if chosen in (None, name):
            module = importlib.import_module(module_name)
            module.add_cli_args(sub)
            sub.set_defaults(handler=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
    )
    # Per-request client logs would drown what kvtune says.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        # soft_wrap: a one-line error stays one line (and greppable) when stderr is not a terminal.
        Console(stderr=True, soft_wrap=True).print("[red]error:[/red]", escape(str(exc)), highlight=False)
        return ExitCode.CONFIG
    except KeyboardInterrupt:
        Console(stderr=True).print("interrupted")
        return ExitCode.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
