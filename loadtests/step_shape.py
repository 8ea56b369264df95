"""Step or ramp load: add users in steps (or one by one), hold each level, then stop.

Combine it with any workload file:

    locust -f loadtests/shared_prefix.py,loadtests/step_shape.py --host URL --headless \\
        --step-users 2 --step-seconds 30 --steps 4 [--ramp]
"""

from __future__ import annotations

import argparse

from locust import LoadTestShape, events


@events.init_command_line_parser.add_listener
def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--step-users", env_var="KVTUNE_STEP_USERS", type=int, default=2, help="users added at each step"
    )
    parser.add_argument(
        "--step-seconds",
        env_var="KVTUNE_STEP_SECONDS",
        type=float,
        default=30.0,
        help="how long each level holds",
    )
    parser.add_argument(
        "--steps", env_var="KVTUNE_STEPS", type=int, default=4, help="number of levels before the test ends"
    )
    parser.add_argument(
        "--ramp",
        env_var="KVTUNE_RAMP",
        action="store_true",
        help="add each step's users gradually, not at once",
    )


class StepShape(LoadTestShape):
    """Level k (1-based) runs k x --step-users users for --step-seconds; None ends the test."""

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
