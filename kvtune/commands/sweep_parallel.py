"""`kvtune sweep SPEC --parallel N`: N workers of one study on this host, each on its own device slot.

The parent plans the slots (kvtune.sweep.devices), starts one `kvtune sweep --join` worker per slot on the
run's study (a journal file in the run folder, or --storage), shows what each is measuring until all end,
then writes the one report and validates the winner alone. Ctrl-C stops every worker (each keeps its
finished trials and frees its claim) before the parent exits 130.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from kvtune.exit_codes import ExitCode
from kvtune.stop_request import StopRequest, requested_by_signals
from kvtune.sweep.devices import Slot
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.study import SharedStudy
from kvtune.sweep.sweeper import SweepProgress
from kvtune.sweep.trial import TrialPlan

STUDY_FILE = "study.journal"
WORKERS_DIR = "workers"
# How often the parent looks at the study for what the workers are doing.
WATCH_S = 2.0
# Seconds a worker has to stop its engine and load after Ctrl-C before it is killed.
STOP_S = 60.0


def worker_command(
    args: argparse.Namespace, study: SharedStudy, storage_url: str, run: Path, slot: Slot
) -> list[str]:
    command = [
        sys.executable, "-m", "kvtune.cli", "sweep", "--join", study.name, "--storage", storage_url,
        "--runs-dir", str(run / WORKERS_DIR), "--devices", slot.as_flag(),
    ]  # fmt: skip
    if args.cache_dir is not None:
        command += ["--cache-dir", str(args.cache_dir)]
    if args.grafana_url:  # every worker annotates its own trials (the token by its variable's name)
        command += ["--grafana-url", args.grafana_url, "--grafana-token-env", args.grafana_token_env]
    return command


def run_workers(
    args: argparse.Namespace,
    study: SharedStudy,
    storage_url: str,
    run: Path,
    slots: list[Slot],
    console: Console,
) -> int:
    """Every slot's worker, from start to end: OK once all ended, FAILED when one did not end as a sweep does
    (it is named; its finished trials still count), INTERRUPTED after Ctrl-C."""
    (run / WORKERS_DIR).mkdir(exist_ok=True)
    workers: list[tuple[Slot, subprocess.Popen[bytes], Path]] = []
    for index, slot in enumerate(slots, 1):
        log = run / WORKERS_DIR / f"worker-{index}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                worker_command(args, study, storage_url, run, slot),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
        workers.append((slot, process, log))
        console.print(f"worker {index}: {slot.describe()}, pid {process.pid}, log {escape(str(log))}")
    with requested_by_signals() as stop:
        _watch(study, workers, console, stop)
    if stop.is_set():
        _stop(workers)
        console.print("[yellow]interrupted[/yellow]: every worker stopped; finished trials are in the study")
        return ExitCode.INTERRUPTED
    failed = False
    for index, (_slot, process, log) in enumerate(workers, 1):
        if process.returncode not in (ExitCode.OK, ExitCode.FAILED):
            failed = True
            console.print(
                f"[red]worker {index} exited {process.returncode}[/red]: see {escape(str(log))}; the configs "
                "it finished count, the one it held was measured by another worker or is missing"
            )
    return ExitCode.FAILED if failed else ExitCode.OK


def _watch(
    study: SharedStudy,
    workers: list[tuple[Slot, subprocess.Popen[bytes], Path]],
    console: Console,
    stop: StopRequest,
) -> None:
    """Show what each worker is doing until every one has ended or a stop is asked for."""
    shown: dict[str, str] = {}
    while any(process.poll() is None for _slot, process, _log in workers) and not stop.is_set():
        for worker, knobs, note in study.running():
            line = f"{knobs}: {note}"
            if shown.get(worker) != line:
                shown[worker] = line
                console.print(f"[cyan]{escape(worker)}[/cyan] {escape(line)}")
        stop.wait(WATCH_S)


def _stop(workers: list[tuple[Slot, subprocess.Popen[bytes], Path]]) -> None:
    for _slot, process, _log in workers:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + STOP_S
    for _slot, process, _log in workers:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class NotingProgress:
    """A worker's progress, also written to the study for the parent (and optuna-dashboard) to show."""

    def __init__(self, inner: SweepProgress, study: SharedStudy) -> None:
        self.inner = inner
        self.study = study

    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None:
        self.inner.trial_started(number, planned, plan)

    def phase(self, phase: str, line: str) -> None:
        self.inner.phase(phase, line)
        self.study.note(line)

    def trial_finished(self, record: TrialRecord) -> None:
        self.inner.trial_finished(record)
