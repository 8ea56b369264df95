"""Parallel sweeps: the same space searched by one worker on one core, then by two workers at one core each
(`kvtune sweep --parallel 2`), side by side in one run; the wall times, the speed-up, and whether both found
the same winner (and if not, each config's goodput under both, so the reason shows).

Honest about this host: it has two cores, so the two workers' engines and load generators share the host
(one core each) where the single worker had one core to itself and the other core idle; both searches'
rates are per core. The spec is deploy/sweeps/cpu-quick.yaml's workload over max_num_batched_tokens x
max_num_seqs (its reserved-cores knob left out: every trial engine is bound to its own core), validation
off (what is compared is the search).

Run: `make bench-parallel` (about 25 minutes per repetition), `python -m benchmarks.parallel --repeats N`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from kvtune.sweep.records import RunSummary
from kvtune.sweep.study import SharedStudy, open_storage

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "deploy" / "sweeps" / "cpu-quick.yaml"
console = Console()


def _spec(folder: Path, core: int) -> Path:
    """cpu-quick's space and workload, without its reserved-cores knob (each trial engine is bound to its
    own cores here), the base profile computing on CORE alone (the one-worker run; --parallel 2 binds each
    trial to its slot's core instead)."""
    data: dict[str, Any] = yaml.safe_load(SPEC.read_text())
    base = yaml.safe_load((SPEC.parent / data["base_profile"]).read_text())
    # Eager engines (fast starts) as deployed: with validation off, trials must run as best.yaml would.
    base |= {"cpu_threads_bind": str(core), "cpu_reserved_cores": None, "enforce_eager": True}
    (folder / "base.yaml").write_text(yaml.safe_dump(base))
    data["space"].pop("cpu_reserved_cores", None)
    data.pop("trial", None)
    data["space"]["max_num_seqs"] = [8, 16]
    data |= {"base_profile": "base.yaml", "validation": {"enabled": False}, "drift_check": False}
    data["budget"] = {"trials": 4, "wall_minutes": 60}  # one core per trial: slower than the demo's two
    data["name"] = "bench-parallel"
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _sweep(spec: Path, runs: Path, workers: int, cores: set[int]) -> tuple[float, RunSummary]:
    """One search; its wall time and summary. One worker is pinned to one core, as each of two would be."""
    runs.mkdir(parents=True)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "sweep", str(spec), "--runs-dir", str(runs),
         "--parallel", str(workers)],
        preexec_fn=lambda: os.sched_setaffinity(0, cores), capture_output=True, text=True, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    if done.returncode not in (0, 1):
        raise SystemExit(f"the {workers}-worker sweep failed ({done.returncode}):\n{done.stderr[-3000:]}")
    (run,) = [p for p in runs.iterdir() if p.is_dir() and not p.is_symlink()]
    if workers > 1:  # both workers measured: a worker that broke at once would leave a serial search
        study = SharedStudy.join(open_storage(str(run / "study.journal")), "bench-parallel")[0]
        measured_by = {record.worker for record in study.records()}
        if len(measured_by) != workers:
            raise SystemExit(f"only {len(measured_by)} of {workers} workers measured: see {run}/workers/")
    return elapsed, RunSummary.model_validate_json((run / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, for the spread (default 1)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("two workers at one core each need two cores")
    table = Table(title="The cpu-quick space: one worker on one core vs two workers at one core each")
    for column in (
        "run",
        "1 worker (s)",
        "2 workers (s)",
        "speed-up",
        "winner, 1 worker",
        "winner, 2 workers",
    ):
        table.add_column(column)
    goodputs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvtune-bench-parallel-") as tmp:
        folder = Path(tmp)
        spec = _spec(folder, cores[0])
        for repeat in range(1, args.repeats + 1):
            one_s, one = _sweep(spec, folder / f"one-{repeat}", 1, {cores[0]})
            two_s, two = _sweep(spec, folder / f"two-{repeat}", 2, set(cores[:2]))
            winners = [s.best.config_id if s.best else "none" for s in (one, two)]
            table.add_row(str(repeat), f"{one_s:.0f}", f"{two_s:.0f}", f"{one_s / two_s:.2f}x", *winners)
            if winners[0] != winners[1]:
                by_config = {c.config_id: c.mean_goodput for c in one.configs}
                goodputs += [
                    f"run {repeat}: {c.config_id} {by_config.get(c.config_id, 0):.3g} (1 worker) vs "
                    f"{c.mean_goodput:.3g} req/s (2 workers)"
                    for c in two.configs
                ]
    console.print(table)
    for line in goodputs:
        console.print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
