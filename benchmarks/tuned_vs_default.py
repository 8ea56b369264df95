"""The sweep benchmark: a grid whose best config sits inside a knob's range, validated on held-out load.

One run of `kvtune sweep`'s own code on `deploy/sweeps/cpu-tradeoff.yaml` as a full grid (so every config
is measured and the search strategies can be replayed over it), with its validation step: the winner as
`best.yaml` deploys it, the base profile as written and vLLM's defaults (`vllm serve MODEL` with only what
the host forces), each measured again on held-out seeds, side by side, with repeats for intervals.

Targets (exit 0 when all hold):
- the best config is interior on at least one knob: along that knob (the other knobs as the best's) its
  value is neither end of the range and both ends measured lower;
- on the held-out load the winner's goodput is >= 1.3x vLLM's defaults' (the ratio's conservative 95%
  interval is printed with it; the base profile's ratio is reported beside it, whatever it is);
- model-based search (TPE) reaches within 5% of the grid's best in at most a third of the grid's trials,
  median over 200 seeded replays (`benchmarks/search_efficiency.py`).
Run: `python -m benchmarks.tuned_vs_default` (or `make bench-sweep`); `--run RUN_DIR` re-reads a finished run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import search_efficiency
from kvtune.commands.common import interrupted_by_signals
from kvtune.files import write_atomic
from kvtune.model_store import resolve_model
from kvtune.sweep import run_dir, validation_report
from kvtune.sweep.records import ConfigSummary, RunSummary, TrialRecord, describe
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import TrialPlan

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "deploy" / "sweeps" / "cpu-tradeoff.yaml"
OUT = REPO / "benchmarks" / "out"
TARGET_OVER_DEFAULTS = 1.3
console = Console()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tuned_vs_default", description=__doc__)
    parser.add_argument("--spec", type=Path, default=SPEC, help="sweep spec (default %(default)s)")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--run", type=Path, default=None, help="re-read a finished sweep run folder")
    runs.add_argument(
        "--resume", type=Path, default=None, help="finish an interrupted run; trials that raised run again"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where runs go (default %(default)s)")
    return parser.parse_args(argv)


class Printer:
    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None:
        console.print(f"trial {number}/{planned} [{plan.config_id}] {describe(plan.knobs)}")

    def phase(self, phase: str, line: str) -> None:
        console.print(f"  {line}", style="dim")

    def trial_finished(self, record: TrialRecord) -> None:
        console.print(f"  -> {record.status}, goodput {record.goodput:.3g} req/s {record.reason or ''}")


def along(configs: list[ConfigSummary], best: ConfigSummary, knob: str) -> list[ConfigSummary]:
    """The configs that differ from `best` only in `knob`, in that knob's order."""
    others = {k: v for k, v in best.knobs.items() if k != knob}
    line = [c for c in configs if {k: v for k, v in c.knobs.items() if k != knob} == others]
    return sorted(line, key=lambda c: c.knobs[knob])


def interior_knobs(summary: RunSummary, candidates: dict[str, list[Any]]) -> list[str]:
    """Knobs on which the best config is interior: along that knob (the other knobs as the best's), the
    best goodput is at neither end of the range, and both ends measured lower (a plateau inside counts)."""
    best = summary.best
    if best is None:
        return []
    found = []
    for knob, values in candidates.items():
        line = along(summary.configs, best, knob)
        if len(set(values)) < 3 or len(line) < 3:
            continue
        ends = (line[0].mean_goodput, line[-1].mean_goodput)
        if (
            best.knobs[knob] not in (line[0].knobs[knob], line[-1].knobs[knob])
            and max(ends) < best.mean_goodput
        ):
            found.append(knob)
    return found


def print_landscape(summary: RunSummary, candidates: dict[str, list[Any]]) -> None:
    best = summary.best
    if best is None:
        return
    for knob in candidates:
        table = Table(title=f"goodput along {knob} (other knobs as the winner: {describe(best.knobs)})")
        line = along(summary.configs, best, knob)
        for config in line:
            table.add_column(f"{knob}={config.knobs[knob]}", justify="right")
        table.add_row(
            *(f"{c.mean_goodput:.3g}" + (" *" if c.config_id == best.config_id else "") for c in line)
        )
        console.print(table)


def _held_out_ratio(summary: RunSummary, baseline: str) -> Any:
    validation = summary.validation
    if validation is None:
        return None
    held_out = next(iter(validation.loads))  # the search's workload with other seeds comes first
    return next((r for r in validation.ratios if r.baseline == baseline and r.load == held_out), None)


def main(argv: list[str] | None = None) -> int:
    with interrupted_by_signals():
        return _main(parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    run = args.run or args.resume
    if run is None or args.resume is not None:
        spec: SweepSpec = load_spec(args.spec) if run is None else run_dir.open_existing(run)
        run = run or run_dir.create(args.out, spec, args.spec)
        console.print(f"sweep {spec.name} into {run}")
        model = resolve_model(spec.base().model)
        run_sweep(spec, run, model_path=model, progress=Printer())
    summary = RunSummary.model_validate_json((run / run_dir.SUMMARY_FILE).read_text())
    if summary.best is None or summary.validation is None:
        console.print("[red]the sweep found no config meeting the SLO, or did not validate one[/red]")
        return 1
    candidates = load_spec(run / run_dir.SPEC_FILE).candidates()
    print_landscape(summary, candidates)
    interior = interior_knobs(summary, candidates)
    console.print(
        f"interior optimum on: {', '.join(interior) or 'no knob'} ({'PASS' if interior else 'FAIL'}); "
        f"winner {describe(summary.best.knobs)}, {summary.best.mean_goodput:.3g} req/s in the grid"
    )
    validation = summary.validation
    table = Table(title="validation on held-out load (one run, side by side)")
    for column in ("config", "load", "goodput", "verdict"):
        table.add_column(column)
    for row in validation_report.rows(validation):
        table.add_row(row.config, row.load, row.goodput, row.verdict)
    console.print(table)
    over_defaults, over_base = _held_out_ratio(summary, "vllm-defaults"), _held_out_ratio(summary, "base")
    for ratio in (over_defaults, over_base):
        if ratio is not None:
            console.print(
                f"{validation_report.compared_label(validation)} {validation_report.ratio_text(ratio)}"
            )
    beats_defaults = bool(
        over_defaults and over_defaults.ratio and over_defaults.ratio >= TARGET_OVER_DEFAULTS
    )
    console.print(
        f"goodput over vLLM's defaults on held-out load >= {TARGET_OVER_DEFAULTS}x: "
        f"{'PASS' if beats_defaults else 'FAIL'}"
    )
    console.print("\nsearch efficiency over this grid:")
    efficiency = search_efficiency.main([str(run)])
    result = {
        "spec": str(args.spec),
        "run": str(run),
        "winner": summary.best.knobs,
        "interior_knobs": interior,
        "winner_held": validation.winner_passed,
        "over_defaults": over_defaults.model_dump() if over_defaults else None,
        "over_base": over_base.model_dump() if over_base else None,
        "search_efficiency_passed": efficiency == 0,
    }
    write_atomic(run / "benchmark.json", json.dumps(result, indent=2))
    console.print(f"figures: {run / 'benchmark.json'}; report: {run / 'report.md'}")
    return 0 if interior and beats_defaults and efficiency == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
