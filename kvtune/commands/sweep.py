"""`kvtune sweep SPEC`: search engine configs under load against a latency SLO, and write the winner."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from kvtune.commands import sweep_parallel
from kvtune.commands.common import (
    ExitCode,
    add_cache_dir_flag,
    port_number,
    positive_count,
    stop_requested_by_signals,
)
from kvtune.model_store import ModelPrepareError, resolve_model
from kvtune.observability import grafana
from kvtune.sweep import dashboard, grafana_annotations, run_dir, validation_report
from kvtune.sweep.devices import Slot, plan_slots, share_note
from kvtune.sweep.quality_hook import quality_for
from kvtune.sweep.records import TrialRecord, ValidationSummary, config_id, describe
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.storage import StudyRecord, secret_problem, storage_problem
from kvtune.sweep.study import SharedStudy, StoredSpec, open_storage, shown_url, study_name_problem
from kvtune.sweep.sweeper import (
    SweepInterrupted,
    SweepOutcome,
    estimate_seconds,
    estimate_validation_seconds,
    plan,
    planned_trials,
    run_sweep,
)
from kvtune.sweep.trial import SweepLoadError, TrialPlan


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, nargs="?", metavar="SPEC", help="sweep spec YAML (deploy/sweeps/)")
    parser.add_argument(
        "--resume", type=Path, metavar="RUN_DIR", help="finish an interrupted run (finished trials are kept)"
    )
    parser.add_argument(
        "--storage",
        metavar="URL",
        help="share the sweep with other workers through this Optuna storage: a journal file path (one "
        "host, or a shared filesystem) or postgresql://USER@HOST/DB (password from PGPASSWORD or ~/.pgpass; "
        "a URL holding one, in any part, is refused)",
    )
    parser.add_argument(
        "--study", metavar="NAME", help="with SPEC and --storage: the study's name (default: the spec's name)"
    )
    parser.add_argument(
        "--join", metavar="STUDY", help="with --storage: measure configs of this study (its own spec)"
    )
    parser.add_argument(
        "--collect",
        metavar="STUDY",
        help="with --storage: write this study's report and winner from every worker's trials, validating "
        "the winner if no worker did; measures no config",
    )
    parser.add_argument(
        "--parallel",
        type=positive_count,
        default=1,
        metavar="N",
        help="with SPEC: N trials at once, each engine and its load generator on its own cores (CPU) or "
        "GPUs (CUDA), planned before anything starts; the winner is then validated alone",
    )
    parser.add_argument(
        "--dashboard",
        nargs="?",
        const=8080,
        type=port_number,
        metavar="PORT",
        help="serve the sweep's study in optuna-dashboard on 127.0.0.1:PORT (default 8080) while it runs; "
        "read-only: requests other than GET and HEAD are refused",
    )
    parser.add_argument(
        "--dashboard-writable",
        action="store_true",
        help=f"with --dashboard: let anyone who reaches 127.0.0.1:PORT {dashboard.WRITES} through it",
    )
    # A worker of --parallel: its devices (cores:0-1 or gpus:0,1). Not for users: --parallel passes it.
    parser.add_argument("--devices", help=argparse.SUPPRESS)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the trials, pruned configs and an estimated time; run nothing and write nothing (a "
        "--storage is only read)",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=Path("runs"),
        help="where run folders are created (default %(default)s)",
    )
    add_cache_dir_flag(parser)
    parser.add_argument(
        "--grafana-url", metavar="URL", help="post one annotation per finished trial to this Grafana"
    )
    parser.add_argument(
        "--grafana-token-env",
        metavar="NAME",
        default="GRAFANA_TOKEN",
        help="environment variable holding the Grafana service account token (default %(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)  # paths and the resume command stay copyable
    problem = _modes_problem(args)
    if problem:
        console.print(f"error: {escape(problem)}")
        return ExitCode.CONFIG
    study: SharedStudy | None = None
    slots: list[Slot] = []
    slot = Slot.from_flag(args.devices) if args.devices else None
    if args.spec is not None and args.parallel > 1:
        planned = load_spec(args.spec)
        slots = plan_slots(  # exit 2 now, before anything starts
            planned.base().adapted_to_host()[0], args.parallel, knobs=tuple(planned.space)
        )
    if args.dry_run:
        return _dry_run_of(args, console)
    recorded = StudyRecord.of_run(args.resume) if args.resume is not None else None
    if recorded is not None:
        # A worker's run folder of a shared study: resumed by joining the study again, in the same folder.
        study, _stored = SharedStudy.join(open_storage(recorded.storage), recorded.study)
        spec = run_dir.open_existing(args.resume)
        console.print(
            f"study {study.name} in {escape(shown_url(recorded.storage))}: worker {study.worker.name}"
        )
    elif args.storage:
        storage = open_storage(args.storage)  # unreachable or a credential in the URL: exit 2 now
        if args.spec is not None:
            spec = load_spec(args.spec)
            study = SharedStudy.create_or_join(
                storage, args.study or spec.name, StoredSpec.of(spec, args.spec)
            )
        else:
            study, stored = SharedStudy.join(storage, args.join or args.collect)
            run = run_dir.create_joined(args.runs_dir, study.name, stored.spec_yaml, stored.base_profile)
            spec = run_dir.open_existing(run)
        console.print(f"study {study.name} in {escape(shown_url(args.storage))}: worker {study.worker.name}")
    else:
        spec = run_dir.open_existing(args.resume) if args.resume else load_spec(args.spec)
    base, _configs = plan(spec)
    base.check_credentials()  # a missing API key or secret fails now, not in the first trial
    try:  # a wrong Grafana address or token fails now too; a Grafana failing later never stops the sweep
        board = (
            grafana.connect_with_env(args.grafana_url, token_env=args.grafana_token_env)
            if args.grafana_url
            else None
        )
    except grafana.GrafanaError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return ExitCode.CONFIG
    if args.resume is not None:
        run = args.resume
    elif study is None or args.spec is not None:
        run = run_dir.create(args.runs_dir, spec, args.spec)
    storage_url = args.storage or str(run / sweep_parallel.STUDY_FILE)
    if (slots or args.dashboard is not None) and study is None:  # a study of the run's own, in its folder
        study = SharedStudy.create_or_join(
            open_storage(storage_url), spec.name, StoredSpec.of(spec, args.spec)
        )
    if study is not None and args.resume is None:  # where `--resume RUN` finds the study again
        StudyRecord(storage=args.storage or storage_url, study=study.name).write(run)
    if slot is not None:
        # This worker and its Locust on its trial engine's cores. After the spec is read: the base profile
        # may bind other cores of the host (each trial's engine is placed on the slot instead).
        slot.pin_this_process()
    try:
        model_path = resolve_model(base.model, args.cache_dir)
    except ModelPrepareError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return ExitCode.FAILED
    with contextlib.ExitStack() as stack:
        if args.dashboard is not None and study is not None:
            writable = args.dashboard_writable
            url = stack.enter_context(dashboard.serving(study.storage, args.dashboard, writable=writable))
            console.print(
                f"optuna-dashboard: {url} (study {study.name}; {dashboard.access_note(writable)}; it stops "
                "with this sweep)"
            )
        workers_code: int = ExitCode.OK
        if slots and study is not None:
            workers_code = sweep_parallel.run_workers(args, study, storage_url, run, slots, console)
            if workers_code == ExitCode.INTERRUPTED:
                return workers_code
        code = _run(args, spec, run, study, slots, slot, board, model_path, console)
        # A worker that broke fails the run even when the others' results make a report.
        return code if workers_code == ExitCode.OK else max(code, workers_code)


def _run(
    args: argparse.Namespace,
    spec: SweepSpec,
    run: Path,
    study: SharedStudy | None,
    slots: list[Slot],
    slot: Slot | None,
    board: grafana.Grafana | None,
    model_path: str | None,
    console: Console,
) -> int:
    """The sweep itself (this worker's part of a study's), its outcome printed; the exit code."""
    console.print(f"sweep {spec.name}: run folder {run}")
    _print_rate_note(spec, console)
    try:
        with (
            # A stop is a flag the sweep reads between trials (it ends the trial's processes at once): an
            # exception raised from a signal could land inside the progress bar's lock and hang it.
            stop_requested_by_signals() as stop,
            _RichProgress(console, spec) as rich_progress,
            grafana_annotations.annotating(rich_progress, board, run.resolve().name) as annotated,
        ):
            progress = sweep_parallel.NotingProgress(annotated, study) if study is not None else annotated
            outcome = run_sweep(
                spec,
                run,
                model_path=model_path,
                progress=progress,
                quality=quality_for,
                study=study,
                measure=not (args.collect or slots),
                slot=slot,
                validate=slot is None,  # a --parallel worker leaves validation to its parent
                share_note=share_note(slots),
                stop=stop,
            )
    except SweepInterrupted as stop:
        _print_outcome(stop.outcome, console)
        again = f"kvtune sweep --resume {shlex.quote(str(run))}"
        console.print(
            f"[yellow]interrupted[/yellow]: every finished trial is in {escape(str(run))}; "
            f"resume with:\n  {escape(again)}"
        )
        return ExitCode.INTERRUPTED
    except SweepLoadError as exc:
        console.print(f"[red]error:[/red] the load could not run: {escape(str(exc))}")
        console.print(f"finished trials are kept in {escape(str(run))}")
        return ExitCode.FAILED
    _print_outcome(outcome, console)
    validation = outcome.summary.validation
    if outcome.summary.best is None:
        return ExitCode.FAILED  # nothing to deploy
    if spec.validation.enabled and (validation is None or not validation.winner_passed):
        return ExitCode.FAILED  # a winner that did not hold on held-out load, or was never validated
    return ExitCode.OK


def _modes_problem(args: argparse.Namespace) -> str | None:
    """Why these flags do not name one way to run a sweep; None when they do."""
    modes = [name for name, given in (
        ("SPEC", args.spec is not None), ("--resume", args.resume is not None),
        ("--join", args.join is not None), ("--collect", args.collect is not None),
    ) if given]  # fmt: skip
    if len(modes) != 1:
        return (
            "give one of SPEC (start a sweep), --resume RUN_DIR (finish one), --join STUDY or --collect "
            f"STUDY (with --storage); got {' and '.join(modes) or 'none'}"
        )
    if (args.join or args.collect) and not args.storage:
        return f"{modes[0]} {args.join or args.collect}: give --storage URL, where the study is"
    if args.storage and args.resume:
        return "--resume RUN_DIR finds a study's storage in the run folder (study.json); give no --storage"
    if args.dashboard is not None and args.resume:
        return "--dashboard shows a study; a run folder has none: start the sweep with --dashboard, or --join"
    if args.parallel > 1 and args.spec is None:
        return "--parallel N starts a sweep from a SPEC; to add workers to a study, run --join on each host"
    if args.study and not (args.spec and args.storage):
        return "--study names the study SPEC starts with --storage; --join and --collect take its name"
    if args.dashboard_writable and args.dashboard is None:
        return "--dashboard-writable opens the writes of --dashboard; give --dashboard too"
    for flag, name in (("--study", args.study), ("--join", args.join), ("--collect", args.collect)):
        if name is not None and (bad_name := study_name_problem(name)):
            return f"{flag}: {bad_name}"
    if args.storage is not None and (bad_storage := storage_problem(args.storage)):
        # Checked before anything reads or connects; a credential in the URL is never quoted back.
        shown = "" if secret_problem(args.storage) else f" {shown_url(args.storage)}"
        return f"--storage{shown}: {bad_storage}"
    return None


def _dry_run_of(args: argparse.Namespace, console: Console) -> int:
    """The plan, with the study it would create or join read but not written: no run folder, no study, no
    journal record (the storage is opened read-only)."""
    recorded = StudyRecord.of_run(args.resume) if args.resume is not None else None
    if recorded is not None:
        study, _stored = SharedStudy.join(open_storage(recorded.storage, read_only=True), recorded.study)
        console.print(f"study {study.name} in {escape(shown_url(recorded.storage))}: would join it (dry run)")
        return _dry_run(run_dir.open_existing(args.resume), console)
    if not args.storage:
        return _dry_run(run_dir.open_existing(args.resume) if args.resume else load_spec(args.spec), console)
    shown = escape(shown_url(args.storage))
    found = open_storage(args.storage, read_only=True)
    if args.spec is not None:
        spec = load_spec(args.spec)
        name = args.study or spec.name
        there = SharedStudy.preview(found, name, StoredSpec.of(spec, args.spec))
        doing = "would join it" if there == "exists" else "would create it"
        console.print(f"study {name} in {shown}: {doing} (dry run: nothing is written)")
        return _dry_run(spec, console)
    study, stored = SharedStudy.join(found, args.join or args.collect)
    console.print(f"study {study.name} in {shown}: would join it (dry run: nothing is written)")
    # The study's spec names its base profile as a file beside it: both are read from a private temporary
    # folder, removed before the dry run ends.
    with tempfile.TemporaryDirectory(prefix="kvtune-dry-run-") as folder:
        run = run_dir.create_joined(Path(folder), study.name, stored.spec_yaml, stored.base_profile)
        return _dry_run(run_dir.open_existing(run), console)


def _dry_run(spec: SweepSpec, console: Console) -> int:
    base, configs = plan(spec)
    table = Table(title=f"{spec.name}: {len(configs)} configs ({spec.strategy}, budget {spec.budget.trials})")
    for column in ("#", "config", "knobs", "KV tokens", "plan"):
        table.add_column(column)
    for index, candidate in enumerate(configs, 1):
        tokens = candidate.profile.kv_capacity_tokens() if candidate.profile else None
        table.add_row(
            str(index),
            config_id(candidate.knobs),
            describe(candidate.knobs),
            f"{tokens:,}" if tokens else "set by vLLM",
            _plan_text(candidate.pruned, candidate.skipped(spec.prune_by_kv)),
        )
    Console().print(table)
    feasible = sum(1 for c in configs if not c.skipped(spec.prune_by_kv))
    trials = min(spec.budget.trials, feasible)
    seconds = estimate_seconds(spec, base, trials)
    validating = estimate_validation_seconds(spec, base)
    console.print(
        f"{trials} trial(s) x {spec.repeats} repeat(s) to run, {len(configs) - feasible} pruned; "
        f"estimated {seconds / 60:.0f} min (wall-time budget {spec.budget.wall_minutes:g} min)"
        + (f", then about {validating / 60:.0f} min of validation on held-out load" if validating else "")
    )
    _print_rate_note(spec, console)
    return ExitCode.OK


def _print_rate_note(spec: SweepSpec, console: Console) -> None:
    if note := spec.passable_rate_note():
        console.print(f"[yellow]note[/yellow]: {escape(note)}")


def _plan_text(pruned: str | None, skipped: bool) -> str:
    if pruned is None:
        return "measure"
    if skipped:
        return f"[red]pruned[/red]: {escape(pruned)}"
    return f"measure (prune_by_kv is off; expect preemptions: {escape(pruned)})"


def _print_outcome(outcome: SweepOutcome, console: Console) -> None:
    summary = outcome.summary
    table = Table(title=f"{summary.name}: {summary.trials_run} trial(s) in {summary.elapsed_s / 60:.1f} min")
    for column in ("config", "knobs", "status", "goodput req/s"):
        table.add_column(column)
    for config in summary.configs:
        mark = " [green]best[/green]" if summary.best and config.config_id == summary.best.config_id else ""
        goodput = "-"
        if config.status == "done":
            # A censored figure is a lower bound (no rate above it was decided to miss).
            goodput = f"{'≥ ' if config.lower_bound_only else ''}{config.mean_goodput:.3g}"
        table.add_row(config.config_id + mark, describe(config.knobs), config.status, goodput)
    Console().print(table)
    if any(c.lower_bound_only for c in summary.configs):
        console.print("≥: censored, only a lower bound: no rate above it was decided to miss the SLO")
    for comparison in summary.comparisons:
        console.print(escape(f"{comparison.first} over {comparison.second}: {comparison.why}"))
    if summary.within_noise:
        console.print(f"note: {escape(summary.within_noise)}")
    if summary.best is None:
        console.print("[red]no config met the SLO at any rate tried[/red]; see the report for why")
    if summary.envelope:
        console.print(f"[yellow]serving envelope[/yellow]: {escape(summary.envelope)}")
    if summary.validation is not None:
        _print_validation(summary.validation, console)
    for name, path in outcome.outputs.items():
        console.print(f"{name}: {escape(str(path))}")
    if "best" in outcome.outputs:
        console.print(f"serve the winner: kvtune up {escape(shlex.quote(str(outcome.outputs['best'])))}")


def _print_validation(validation: ValidationSummary, console: Console) -> None:
    table = Table(title="validation on held-out load")
    for column in ("config", "load", "goodput", "tuned", "verdict"):
        table.add_column(column)
    for row in validation_report.rows(validation):
        table.add_row(*(escape(cell) for cell in (row.config, row.load, row.goodput, row.tuned, row.verdict)))
    Console().print(table)
    style = "green" if validation.winner_passed else "red"
    console.print(f"[{style}]{escape(validation_report.headline(validation))}[/{style}]")
    for ratio in validation.ratios:
        label = validation_report.compared_label(validation)
        console.print(escape(f"goodput of {label} {validation_report.ratio_text(ratio)}"))


class _RichProgress:
    """Trial i of n, the current config and phase, and an ETA from the trials finished so far."""

    def __init__(self, console: Console, spec: SweepSpec) -> None:
        self.spec = spec
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(), TimeRemainingColumn(), console=console,
        )  # fmt: skip
        self.task = TaskID(0)
        self.console = console
        self.trial_started_at = time.monotonic()

    def __enter__(self) -> _RichProgress:
        self.progress.start()
        self.task = self.progress.add_task("sweep", total=planned_trials(self.spec))
        return self

    def __exit__(self, *_exc: object) -> None:
        self.progress.stop()

    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None:
        self.trial_started_at = time.monotonic()
        self.current = f"trial {number}/{planned} [{plan.config_id}] {describe(plan.knobs)}"
        self.progress.update(self.task, description=escape(self.current), total=planned)

    def phase(self, phase: str, line: str) -> None:
        # Validation lines name their own config; trial lines belong to the current trial.
        text = line if phase == "validation" else f"{self.current}: {line}"
        self.progress.update(self.task, description=escape(text))

    def trial_finished(self, record: TrialRecord) -> None:
        self.progress.advance(self.task)
        seconds = time.monotonic() - self.trial_started_at
        result = f"goodput {record.goodput:.3g} req/s" if record.status == "done" else record.reason or ""
        self.console.print(
            # Escaped whole: a config id in brackets ("[b91b1e43]") would otherwise read as rich markup.
            escape(
                f"trial {record.trial} [{record.config_id}] {describe(record.knobs)}: "
                f"{record.status}, {result} ({seconds:.0f} s)"
            )
        )
