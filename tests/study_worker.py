"""A sweep worker for tests of shared studies: `run_sweep` on a study, with scripted trials (no engine).

    python -m tests.study_worker STORAGE RUNS_DIR SECONDS (--spec SPEC | --join STUDY) [--hang-after K]

Each trial writes `claimed-<config>` under RUNS_DIR when it starts, then takes SECONDS, so a test can
kill the worker while it holds a claim.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from kvtune.sweep import run_dir, study
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.spec import SweepSpec, load_spec
from kvtune.sweep.study import SharedStudy, StoredSpec, open_storage
from kvtune.sweep.sweeper import run_sweep
from kvtune.sweep.trial import TrialPlan
from tests.builders import Quiet
from tests.helpers_sweep import measured


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("storage")
    parser.add_argument("runs", type=Path)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--spec", type=Path)
    parser.add_argument("--join")
    parser.add_argument(
        "--hang-after", type=int, help="after this many trials, hold the next claim for 10 min"
    )
    # A database's heartbeat, shortened so a test sees a dead worker's claim failed in seconds.
    parser.add_argument("--heartbeat", type=int, default=study.HEARTBEAT_S)
    parser.add_argument("--grace", type=int, default=study.GRACE_S)
    args = parser.parse_args()
    study.HEARTBEAT_S, study.GRACE_S = args.heartbeat, args.grace
    storage = open_storage(args.storage)
    if args.spec:
        spec = load_spec(args.spec)
        stored = StoredSpec.of(spec, args.spec)
        shared = SharedStudy.create_or_join(storage, spec.name, stored)
        run = run_dir.create(args.runs, spec, args.spec)
    else:
        shared, stored = SharedStudy.join(storage, args.join)
        run = run_dir.create_joined(args.runs, shared.name, stored.spec_yaml, stored.base_profile)
        spec = run_dir.open_existing(run)
    shared.poll_s = 0.5

    done = 0

    def trial(_spec: SweepSpec, plan: TrialPlan, **_: Any) -> TrialRecord:
        nonlocal done
        (args.runs / f"claimed-{plan.config_id}").write_text(shared.worker.name)
        time.sleep(600 if args.hang_after is not None and done >= args.hang_after else args.seconds)
        done += 1
        return measured(plan)

    run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=trial, study=shared)


if __name__ == "__main__":
    main()
