"""`kvtune load`: run one workload against a running engine and print what users felt and the engine did."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvtune.commands.common import ExitCode
from kvtune.config_errors import format_validation_errors
from kvtune.loadgen.results import LoadResult, Percentiles
from kvtune.loadgen.runner import LoadSpec, LoadTestError, run_load


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="engine base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--workload",
        default="shared_prefix",
        choices=("shared_prefix", "long_doc_qa", "multi_turn", "replay"),
    )
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a workload flag, e.g. --arg system-tokens=800 --arg prefix-reuse=0.5",
    )
    parser.add_argument(
        "--users", type=int, default=4, help="closed-loop users / open-loop requests in flight"
    )
    parser.add_argument("--arrival", choices=("closed", "constant", "poisson"), default="closed")
    parser.add_argument("--rate", type=float, default=None, help="open-loop requests per second")
    parser.add_argument("--duration", type=float, default=30.0, help="measured seconds (default %(default)s)")
    parser.add_argument(
        "--warmup", type=float, default=5.0, help="unmeasured seconds first (default %(default)s)"
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--workers", type=int, default=0, help="Locust workers (0: one process)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON here")
    parser.add_argument(
        "--keep-samples", type=Path, default=None, help="keep per-request samples in this folder"
    )


def _workload_args(pairs: list[str]) -> dict[str, str | int | float]:
    args: dict[str, str | int | float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise LoadTestError(f"--arg {pair!r}: expected NAME=VALUE, e.g. --arg system-tokens=800")
        args[name.removeprefix("--")] = value
    return args


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        spec = LoadSpec(url=args.url, workload=args.workload, workload_args=_workload_args(args.arg),
                        users=args.users, arrival=args.arrival, rate=args.rate, duration_s=args.duration,
                        warmup_s=args.warmup, max_tokens=args.max_tokens, workers=args.workers)  # fmt: skip
    except ValidationError as exc:
        console.print(format_validation_errors(exc, LoadSpec, "kvtune load"), markup=False)
        return ExitCode.CONFIG
    except LoadTestError as exc:
        console.print(f"error: {exc}", markup=False)
        return ExitCode.CONFIG
    columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"{spec.workload} against {spec.url}", total=1.0)
        try:
            result = run_load(
                spec,
                log_dir=args.keep_samples,
                on_progress=lambda done: progress.update(task, completed=min(done, 1.0)),
            )
        except LoadTestError as exc:
            console.print(f"error: {exc}", markup=False)
            return ExitCode.CONFIG
    Console().print(result_table(result))
    if args.json:
        args.json.write_text(result.model_dump_json(indent=2))
        console.print(f"result written to {args.json}")
    return ExitCode.OK if result.requests else ExitCode.FAILED


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def result_table(result: LoadResult) -> Table:
    table = Table(title=f"{result.workload}, {result.arrival} loop, {result.window_s:.0f} s measured")
    for column in ("", "p50 ms", "p90 ms", "p99 ms", "mean ms", "n"):
        table.add_column(column, justify="right")
    rows: dict[str, Percentiles] = {"TTFT": result.ttft, "ITL": result.itl, "E2E": result.e2e}
    for name, p in rows.items():
        table.add_row(name, _ms(p.p50), _ms(p.p90), _ms(p.p99), _ms(p.mean), str(p.count))
    engine = result.engine
    hit = "-" if engine.hit_rate is None else f"{engine.hit_rate:.1%}"
    target = "-" if result.target_reuse is None else f"{result.target_reuse:.1%}"
    table.caption = (
        f"{result.requests} requests ({result.errors} errors), {result.request_rate:.2f} req/s, "
        f"{result.output_token_rate:.1f} output tok/s | reuse target {target}, engine hit rate {hit}, "
        f"preemptions {engine.preemptions:.0f}, peak KV {engine.peak_kv_usage:.0%}"
        + (
            f" | intended {result.intended_rate:.2f}/s, sent {result.achieved_rate:.2f}/s, "
            f"unsent {result.unsent}"
            if result.intended_rate
            else ""
        )
    )
    return table
