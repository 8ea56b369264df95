"""`kvtune plan RUN_DIR --peak-rate R`: from a sweep's validated winner, the replicas that serve R req/s
within the SLO, the GPUs that takes, and the autoscaling signal and threshold, as a Helm values overlay.

The arithmetic is `kvtune.sweep.capacity`'s; this module reads the run folder (summary.json, best.yaml, the
winner's trial records, each with the documents' bounds), writes the overlay (RUN_DIR/values-plan.yaml by
default) and prints the plan.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markdown import Markdown

from kvtune.commands.common import ExitCode, positive_count, positive_number
from kvtune.config_errors import ConfigError
from kvtune.documents import dump_yaml
from kvtune.files import output_file_problem, write_atomic
from kvtune.profile import EngineProfile, load_profile
from kvtune.sweep import capacity, run_dir
from kvtune.sweep.records import RunSummary, TrialRecord, read_record

OVERLAY_FILE = "values-plan.yaml"
VALUES_FILE = "values.yaml"
BEST_FILE = "best.yaml"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="a sweep's run folder (the one it printed)"
    )
    parser.add_argument(
        "--peak-rate",
        type=positive_number,
        required=True,
        metavar="R",
        help="the peak request rate to serve within the SLO, req/s (above 0)",
    )
    parser.add_argument(
        "--min-rate",
        type=positive_number,
        metavar="r",
        help="the least rate the autoscaler keeps replicas for, req/s (default: one replica)",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=positive_count,
        metavar="N",
        help="GPUs of one node: a replica needing more (TP x PP x DP) is refused",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help=f"where the values overlay goes (default RUN_DIR/{OVERLAY_FILE}, beside {VALUES_FILE})",
    )


def main(args: argparse.Namespace) -> int:
    run: Path = args.run_dir
    if args.min_rate is not None and args.min_rate > args.peak_rate:
        raise ConfigError(
            f"--min-rate {args.min_rate:g} is above --peak-rate {args.peak_rate:g}; give a --min-rate at "
            "most the peak"
        )
    summary = read_summary(run)
    out: Path = args.out if args.out is not None else run / OVERLAY_FILE
    problem = output_file_problem(out)
    if problem is not None:
        raise ConfigError(f"--out {out}: {problem}")
    bound = capacity.goodput_bound(summary, f"{run}/{run_dir.SUMMARY_FILE}")
    plan = capacity.make_plan(
        summary,
        read_profile(run),
        winner_trials(run, bound.config_id),
        peak_rate=args.peak_rate,
        min_rate=args.min_rate,
        gpus_per_node=args.gpus_per_node,
        run=str(run),
    )
    write_overlay(out, plan, run)
    console = Console()
    console.print(f"Capacity plan of sweep {plan.run} ({run})", style="bold", highlight=False)
    console.print(Markdown("\n".join(plan.lines())))
    console.print(f"wrote {out}: helm upgrade ... -f {run / VALUES_FILE} -f {out}", highlight=False)
    return ExitCode.OK


def read_summary(run: Path) -> RunSummary:
    """summary.json of a finished sweep; ConfigError naming the folder or file and the fix."""
    if not run.is_dir():
        raise ConfigError(f"RUN_DIR {run}: is not a folder; pass the run folder a sweep printed")
    path = run / run_dir.SUMMARY_FILE
    if not path.exists():
        raise ConfigError(
            f"RUN_DIR {run}: has no {run_dir.SUMMARY_FILE}, so it is not a finished sweep run; pass the run "
            f"folder a sweep printed, or finish it with kvtune sweep --resume {run}"
        )
    return read_record(
        RunSummary, path, "a run summary", fix=f"write it again with kvtune sweep --resume {run}"
    )


def read_profile(run: Path) -> EngineProfile:
    """best.yaml: the winning config as deployed (its parallel sizes price a replica)."""
    path = run / BEST_FILE
    if not path.exists():
        raise ConfigError(
            f"RUN_DIR {run}: has no {BEST_FILE} (the winner's profile); write it again with kvtune sweep "
            f"--resume {run}"
        )
    return load_profile(path)


def winner_trials(run: Path, config_id: str) -> list[TrialRecord]:
    """The winner's search trials (every repeat), from their result files; only its folders are read."""
    trials = run / "trials"
    if not trials.is_dir():
        return []
    records = [
        read_record(TrialRecord, folder / run_dir.RESULT_FILE, "a trial record")
        for folder in sorted(trials.glob(f"*-{config_id}-r*"))
        if (folder / run_dir.RESULT_FILE).is_file()
    ]
    return [r for r in records if r.config_id == config_id and r.status == "done"]


def write_overlay(out: Path, plan: capacity.CapacityPlan, run: Path) -> None:
    header = capacity.overlay_header(plan, str(run / VALUES_FILE), str(out))
    values: dict[str, Any] = capacity.overlay(plan)
    write_atomic(out, "".join(f"# {line}\n" for line in header) + dump_yaml(values))
