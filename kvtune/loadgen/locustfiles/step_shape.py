"""Step or ramp load: add users in steps (or one by one), hold each level, then stop.

Combine it with any workload file:

    locust -f loadtests/shared_prefix.py,loadtests/step_shape.py --host URL --headless \\
        --step-users 2 --step-seconds 30 --steps 4 [--ramp]
"""

from __future__ import annotations

from locust import LoadTestShape

from kvtune.loadgen.locust_flags import register_flags
from kvtune.loadgen.workload_args import STEP_SHAPE_ARGS

register_flags("step shape", STEP_SHAPE_ARGS)


class StepShape(LoadTestShape):
    """Level k (1-based) runs k x --step-users users for --step-seconds; None ends the test.

    Locust finds it only in a file that defines or imports it: this one, or a copy that imports it.
    """

    def tick(self) -> tuple[int, float] | None:
        options = self.runner.environment.parsed_options if self.runner else None
        if options is None:
            return None
        level = int(self.get_run_time() // options.step_seconds) + 1
        if level > options.steps:
            return None
        users = level * options.step_users
        spawn_rate = options.step_users / options.step_seconds if options.ramp else float(users)
        return users, spawn_rate
