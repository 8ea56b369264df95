"""Step or ramp load: add users in steps (or one by one), hold each level, then stop.

Combine it with any workload file:

    locust -f loadtests/shared_prefix.py,loadtests/step_shape.py --host URL --headless \\
        --step-users 2 --step-seconds 30 --steps 4 [--ramp]
"""

from __future__ import annotations

from kvtune.loadgen.locust_user import StepShape, register_flags
from kvtune.loadgen.workload_args import STEP_SHAPE_ARGS

register_flags("step shape", STEP_SHAPE_ARGS)

__all__ = ["StepShape"]
