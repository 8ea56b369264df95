"""Tuned vs untuned: the sweep's best config against vLLM's defaults at the spec's starting KV budget.

One run: the sweep (a full grid, so its table also feeds the search-efficiency replay), then both configs
measured again back to back with the same workload, SLO and goodput search. The tuned config must reach
at least 1.5x the default's goodput. Run: `python -m benchmarks.tuned_vs_default` (or `make bench-sweep`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks import search_efficiency
from kvtune.commands.common import interrupted_by_signals
from kvtune.engine import free_port
from kvtune.files import write_atomic
from kvtune.model_store import resolve_model
from kvtune.profile import EngineProfile, load_profile
from kvtune.sweep import run_dir
from kvtune.sweep.records import TrialRecord, describe
from kvtune.sweep.spec import SweepSpec, apply_knobs, load_spec
from kvtune.sweep.summary import explain_miss
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import TrialPlan, run_trial

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "deploy" / "sweeps" / "cpu-full.yaml"
OUT = REPO / "benchmarks" / "out"
TARGET_RATIO = 1.5
BUDGET_KNOBS = ("kv_cache_memory_bytes", "gpu_memory_utilization")
# Knobs vLLM picks itself when a command line leaves them out: the "untuned" config leaves them out.
VLLM_DEFAULTS: dict[str, Any] = {
    "kv_cache_dtype": "auto",
    "kv_cache_dtype_fallback": None,
    "enable_prefix_caching": True,  # vLLM's V1 engine caches prefixes by default
    "block_size": None,
    "max_num_seqs": None,
    "max_num_batched_tokens": None,
    "enable_chunked_prefill": None,
}
console = Console()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tuned_vs_default", description=__doc__)
    parser.add_argument("--spec", type=Path, default=SPEC, help="sweep spec (default %(default)s)")
    parser.add_argument("--run", type=Path, default=None, help="reuse a finished sweep run folder")
    parser.add_argument("--out", type=Path, default=OUT, help="where runs and results go")
    return parser.parse_args(argv)


def untuned_profile(spec: SweepSpec) -> EngineProfile:
    """vLLM's defaults at the spec's starting KV budget (the budget knob's first candidate, else the base
    profile's); knobs with a single candidate are deployment constraints, applied to both configs."""
    base = load_profile(spec.base_profile)
    candidates = spec.candidates()
    constraints = {k: v[0] for k, v in candidates.items() if len(v) == 1 or k in BUDGET_KNOBS}
    data = apply_knobs(base, constraints).model_dump() | VLLM_DEFAULTS
    return EngineProfile.model_validate(data).model_copy(update={"name": "vllm-defaults"})


class Printer:
    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None:
        console.print(f"trial {number}/{planned} [{plan.config_id}] {describe(plan.knobs)}")

    def phase(self, phase: str, line: str) -> None:
        console.print(f"  {line}", style="dim")

    def trial_finished(self, record: TrialRecord) -> None:
        console.print(f"  -> {record.status}, goodput {record.goodput:.3g} req/s {record.reason or ''}")


def measure(spec: SweepSpec, profile: EngineProfile, name: str, folder: Path, number: int) -> TrialRecord:
    adapted, _note = profile.adapted_to_host()
    adapted = adapted.model_copy(update={"name": name, "port": free_port()})
    plan = TrialPlan(number, 1, name, {"config": name}, adapted, folder / name)
    console.print(f"measuring {name}: {' '.join(adapted.vllm_args()[4:])}")
    record = run_trial(spec, plan, model_path=resolve_model(profile.model), progress=Printer().phase)
    run_dir.save_trial(plan.folder, record)
    return record


def main(argv: list[str] | None = None) -> int:
    with interrupted_by_signals():
        return _main(parse_args(argv))


def _main(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    run = args.run
    if run is None:
        run = run_dir.create(args.out, spec, args.spec)
        console.print(f"sweep {spec.name} into {run}")
        run_sweep(
            spec, run, model_path=resolve_model(load_profile(spec.base_profile).model), progress=Printer()
        )
    summary = json.loads((run / run_dir.SUMMARY_FILE).read_text())
    if not summary.get("best"):
        console.print("[red]the sweep found no config meeting the SLO; nothing to compare[/red]")
        return 1
    best_knobs = summary["best"]["knobs"]
    base = load_profile(spec.base_profile)
    side = run / f"side-by-side-{time.strftime('%Y%m%d-%H%M%S')}"
    default = measure(spec, untuned_profile(spec), "vllm-defaults", side, 1)
    tuned = measure(spec, apply_knobs(base, best_knobs), "tuned", side, 2)
    ratio = tuned.goodput / default.goodput if default.goodput else float("inf")
    passed = ratio >= TARGET_RATIO
    table = Table(title=f"tuned vs vLLM defaults at the starting KV budget ({spec.name})")
    for column in ("config", "goodput req/s", "P99 TTFT at goodput", "preemptions (first miss)", "why"):
        table.add_column(column)
    for record in (default, tuned):
        best_step = record.best_step
        first_miss = next((s for s in record.steps if not s.passed), None)
        table.add_row(
            record.config_id,
            f"{record.goodput:.3g}",
            f"{best_step.result.ttft.p99:.2f} s" if best_step and best_step.result.ttft.p99 else "-",
            f"{first_miss.result.engine.preemptions:.0f}" if first_miss else "-",
            explain_miss(first_miss) if first_miss else (record.reason or "never missed"),
        )
    console.print(table)
    console.print(f"tuned knobs: {describe(best_knobs)}")
    verdict = "PASS" if passed else "FAIL"
    console.print(f"goodput ratio tuned / defaults: {ratio:.2f}x (target >= {TARGET_RATIO}x): {verdict}")
    result = {
        "spec": str(args.spec), "run": str(run), "tuned_knobs": best_knobs,
        "default_goodput": default.goodput, "tuned_goodput": tuned.goodput, "ratio": ratio, "passed": passed,
    }  # fmt: skip
    write_atomic(side / "result.json", json.dumps(result, indent=2))
    console.print(f"side-by-side records: {side}")
    console.print("\nsearch efficiency over this grid:")
    efficiency = search_efficiency.main([str(run)])
    return 0 if passed and efficiency == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
