"""`kvtune sweep SPEC` as a user runs it, with scripted trials whose engine is a real process group.

    python -m tests.sweep_stop_child SPEC RUNS_DIR

Each trial starts a stand-in engine (`sleep`, in a session of its own, as kvtune starts vLLM) and polls it
for TRIAL_S, reporting progress through Rich and logging all the while, so a signal is likely to arrive
inside Rich's console lock or logging's. A trial whose engine ended under it returns "infeasible", as
`run_on_engine` does. A trial that had an exception raised into it writes `raised-into` in its folder:
the sweep must stop it by ending its engine, never by raising inside it.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import time
from typing import Any

from kvtune import cli
from kvtune.commands import sweep as sweep_command
from kvtune.sweep import sweeper
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.trial import ProgressFn, TrialPlan
from tests.helpers_sweep import measured

TRIAL_S = 0.6
ENGINE_PID = "engine.pid"
RAISED_INTO = "raised-into"
STARTED = "trial-started"

log = logging.getLogger("tests.sweep_stop_child")


def trial(spec: SweepSpec, plan: TrialPlan, *, progress: ProgressFn, **_: Any) -> TrialRecord:
    plan.folder.mkdir(parents=True, exist_ok=True)
    engine = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (plan.folder / ENGINE_PID).write_text(str(engine.pid))
    (plan.folder.parent.parent / STARTED).touch()
    try:
        deadline = time.monotonic() + TRIAL_S
        while time.monotonic() < deadline:
            if engine.poll() is not None:
                ended = {
                    "repeat": plan.repeat,
                    "status": "infeasible",
                    "reason": "did not start",
                    "goodput": None,
                }
                return measured(plan).model_copy(update=ended | {"steps": []})
            progress("load", f"load step {time.monotonic():.3f}")
            log.info("trial %d polling", plan.number)
        return measured(plan).model_copy(update={"repeat": plan.repeat})
    except BaseException:
        (plan.folder / RAISED_INTO).touch()
        raise
    finally:
        engine.terminate()
        engine.wait()


def main() -> int:
    spec, runs = sys.argv[1], sys.argv[2]
    # The command as shipped, with no model to prepare and the scripted trials in place of engines.
    vars(sweep_command).update(
        resolve_model=lambda _model, _cache_dir: None,
        run_sweep=functools.partial(sweeper.run_sweep, trial_runner=trial),
    )
    return cli.main(["sweep", spec, "--runs-dir", runs])


if __name__ == "__main__":
    sys.exit(main())
