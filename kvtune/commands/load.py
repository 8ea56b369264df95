"""`kvtune load`: run one workload against a running engine and print what users felt and the engine did.

Every input is checked before anything runs (workload flags, output paths, the API key, that the URL is a
vLLM server): a bad one is a one-line error naming the flag, exit code 2. Nothing printed shows a password
in the URL or the API key.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from pydantic import SecretStr, ValidationError
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from kvtune.commands.common import (
    LONGEST_FLAG_SECONDS,
    ExitCode,
    interrupted_by_signals,
    number_between,
    seconds,
    whole_number_between,
)
from kvtune.config_errors import format_validation_errors
from kvtune.credentials import name_may_be_shown, not_a_variable_name
from kvtune.files import output_file_problem, write_atomic
from kvtune.http_client import credential_conflict, shown_url
from kvtune.loadgen.pacing import ARRIVALS
from kvtune.loadgen.results import LoadResult, Percentiles
from kvtune.loadgen.runner import (
    DEFAULT_DURATION_S,
    DEFAULT_WARMUP_S,
    LoadSpec,
    LoadTestError,
    ServerError,
    run_load,
)
from kvtune.loadgen.workload_args import (
    API_KEY_ENV,
    DEFAULT_MAX_TOKENS,
    MOST_MAX_TOKENS,
    MOST_RATE,
    MOST_USERS,
    MOST_WORKERS,
    WORKLOAD_NAMES,
    WorkloadError,
    flags_help,
    validate_workload_args,
)
from kvtune.server_url import ServerUrlError, server_url


class UsageError(ValueError):
    """A flag that cannot be used; str() names it and the fix."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = flags_help()
    parser.add_argument("--url", required=True, help="engine base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--workload", default="shared_prefix", choices=WORKLOAD_NAMES)
    parser.add_argument(
        "--arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a workload flag, e.g. --arg system-tokens=800 --arg prefix-reuse=0.5",
    )
    parser.add_argument("--model", default="", help="served model name (default: the first the server lists)")
    parser.add_argument(
        "--users",
        type=whole_number_between(1, MOST_USERS),
        default=4,
        help=f"closed-loop users / open-loop requests in flight, 1 to {MOST_USERS:,} (default %(default)s)",
    )
    parser.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=None,
        help="closed loop; open loop at --rate (constant, poisson) or at a trace's own times (trace); "
        "default: closed, a trace: trace",
    )
    parser.add_argument(
        "--rate",
        type=number_between(0, MOST_RATE, "req/s", above=True),
        default=None,
        help=f"open-loop requests per second, above 0 and at most {MOST_RATE:,g}",
    )
    parser.add_argument(
        "--duration",
        type=seconds,
        default=None,
        help=f"measured seconds (default {DEFAULT_DURATION_S:g}; a trace: until its requests are answered)",
    )
    parser.add_argument(
        "--warmup",
        type=seconds_or_none,
        default=None,
        help=f"unmeasured seconds first (default {DEFAULT_WARMUP_S:g}; a trace: 0)",
    )
    parser.add_argument(
        "--max-tokens",
        type=whole_number_between(1, MOST_MAX_TOKENS),
        default=DEFAULT_MAX_TOKENS,
        help=f"output tokens per request, 1 to {MOST_MAX_TOKENS:,} (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=whole_number_between(0, MOST_WORKERS),
        default=0,
        help=f"Locust worker processes, 0 to {MOST_WORKERS} (default 0: one process sends everything)",
    )
    parser.add_argument(
        "--request-timeout",
        type=seconds,
        default=LoadSpec.model_fields["request_timeout_s"].default,
        help="seconds a request may take before it counts as failed (default %(default)s)",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the result as JSON here (in an existing folder)"
    )
    parser.add_argument(
        "--keep-samples", type=Path, default=None, help="keep per-request samples in this existing folder"
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        default=None,
        help=f"read the engine's API key from environment variable NAME (default: {API_KEY_ENV}, when set); "
        "the key reaches Locust through its environment only, never a command line or a file",
    )


def seconds_or_none(text: str) -> float:
    """argparse type of a duration that may be 0 (no warm-up), else as `seconds`."""
    with contextlib.suppress(ValueError):
        if float(text) == 0:
            return 0.0
    try:
        return seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text[:40]} is not a usable number of seconds; give 0 (none) or up to {LONGEST_FLAG_SECONDS:,}"
        ) from None


def workload_args(workload: str, pairs: list[str]) -> dict[str, str | int | float]:
    """`--arg NAME=VALUE` pairs, checked against the workload's own flags."""
    args: dict[str, str | int | float] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--arg {pair!r}: expected NAME=VALUE, e.g. --arg system-tokens=800")
        args[name.removeprefix("--")] = value
    try:
        return validate_workload_args(workload, args)
    except WorkloadError as exc:
        raise UsageError(f"--arg: {exc}") from None


def api_key(variable: str | None) -> SecretStr | None:
    """The key from `--api-key-env NAME` (which must be set), else from KVTUNE_API_KEY if set."""
    if variable is None:
        default = os.environ.get(API_KEY_ENV, "")
        return SecretStr(default) if default else None
    if not_a_variable_name(variable):
        raise UsageError(
            "--api-key-env: takes the NAME of an environment variable that holds the key, and what was given "
            "is not a variable name (not shown: it may be the key itself); export the key in a variable, "
            "e.g. MY_ENGINE_KEY, and pass --api-key-env MY_ENGINE_KEY"
        )
    value = os.environ.get(variable, "")
    if not value:
        named = (
            f"--api-key-env {variable}: the environment variable {variable} is"
            if name_may_be_shown(variable)
            else "--api-key-env: the environment variable named (not shown: it may be a key itself) is"
        )
        raise UsageError(
            f"{named} unset or empty; export the engine's API key in it, or name the variable that holds it"
        )
    return SecretStr(value)


def check_url(url: str) -> None:
    """An engine's base URL (kvtune.server_url's rule): anything else would fail later, with less to say."""
    try:
        server_url(url, "http://127.0.0.1:8000")
    except ServerUrlError as exc:
        raise UsageError(f"--url {exc}") from None


def check_output_paths(json_path: Path | None, samples: Path | None) -> None:
    """Before the run: a result must never be lost after it ran because its path cannot take it."""
    if json_path is not None and (problem := output_file_problem(json_path)):
        raise UsageError(f"--json {json_path}: {problem}")
    if samples is not None:
        if not samples.is_dir():
            raise UsageError(f"--keep-samples {samples}: no such folder; create it or pick another")
        if not os.access(samples, os.W_OK):
            raise UsageError(f"--keep-samples {samples}: the folder is not writable; pick another")


def build_spec(args: argparse.Namespace) -> LoadSpec:
    check_url(args.url)
    check_output_paths(args.json, args.keep_samples)
    key = api_key(args.api_key_env)
    given = args.api_key_env or API_KEY_ENV
    named = f"an API key ({given if name_may_be_shown(given) else 'the --api-key-env variable'})"
    if problem := credential_conflict(args.url, key is not None, key_name=named):
        raise UsageError(f"--url {problem}")
    return LoadSpec(
        url=args.url,
        workload=args.workload,
        workload_args=workload_args(args.workload, args.arg),
        model=args.model,
        users=args.users,
        arrival=args.arrival,
        rate=args.rate,
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_tokens=args.max_tokens,
        workers=args.workers,
        request_timeout_s=args.request_timeout,
        api_key=key,
    )


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        spec = build_spec(args)
    except ValidationError as exc:
        console.print(format_validation_errors(exc, LoadSpec, "kvtune load"), markup=False)
        return ExitCode.CONFIG
    except UsageError as exc:
        console.print(f"error: {exc}", markup=False)
        return ExitCode.CONFIG
    columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    shown = shown_url(spec.url)
    with (
        interrupted_by_signals(),  # SIGTERM, like Ctrl-C, stops the Locust processes on its way out
        Progress(*columns, console=console, transient=True) as progress,
    ):
        task = progress.add_task(f"{spec.workload} against {shown}", total=1.0)
        try:
            result = run_load(
                spec,
                log_dir=args.keep_samples,
                on_progress=lambda done: progress.update(task, completed=min(done, 1.0)),
            )
        except ServerError as exc:
            console.print(f"error: --url {shown}: {exc}", markup=False)
            return ExitCode.CONFIG
        except LoadTestError as exc:
            console.print(f"error: {exc}", markup=False)
            return ExitCode.CONFIG
    Console().print(result_table(result))
    for line in result_notes(result):
        console.print(line, markup=False)
    if args.json:
        try:
            write_atomic(args.json, result.model_dump_json(indent=2))
        except OSError as exc:  # the path changed since it was checked (now a folder, a device, read-only)
            console.print(f"error: --json {args.json}: {exc.strerror or exc}", markup=False)
            return ExitCode.FAILED
        console.print(f"result written to {args.json}")
    return ExitCode.OK if result.requests else ExitCode.FAILED


def result_notes(result: LoadResult) -> list[str]:
    """What the table cannot say: why requests failed, and why a window may hold none."""
    notes = []
    if not result.requests and not result.errors:
        notes.append(
            f"no request was sent in the {result.window_s:g} s measured window: its users were still waiting "
            "for answers to requests sent before it; lower --request-timeout or raise --duration"
        )
    notes += [f"failed: {example}" for example in result.error_examples[:3]]
    cuts = result.trace_cuts
    if cuts and cuts.requests:
        notes.append(
            f"{cuts.requests} trace requests were cut to fit the engine's max_model_len: "
            f"{cuts.prompt_tokens:,} prompt and {cuts.output_tokens:,} output tokens"
        )
    if result.engine.counters_reset:
        notes.append("the engine's counters went down during the window (it restarted): its figures count "
                     "from the restart")  # fmt: skip
    return notes


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def result_table(result: LoadResult) -> Table:
    pacing = "its own arrival times" if result.arrival == "trace" else f"{result.arrival} loop"
    table = Table(title=f"{result.workload}, {pacing}, {result.window_s:.3g} s measured")
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
        + (f" | {lateness_text(result)}" if result.lateness else "")
    )
    return table


def lateness_text(result: LoadResult) -> str:
    """How late an open loop sent its requests: late ones waited for a free user (--users)."""
    late = result.lateness
    if late is None or not late.count:
        return "no request sent"
    return (
        f"sent late: {late.late} of {late.count} beyond {late.tolerance_s * 1000:.0f} ms, "
        f"p99 {_ms(late.p99_s)} ms, max {_ms(late.max_s)} ms, unsent {result.unsent}"
    )
