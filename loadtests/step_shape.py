"""Step or ramp load: add users in steps (or one by one), hold each level, then stop.

Combine it with any workload file:

    locust -f loadtests/shared_prefix.py,loadtests/step_shape.py --host URL --headless \\
        --step-users 2 --step-seconds 30 --steps 4 [--ramp]

The shape ships with kvtune (kvtune.loadgen.locustfiles.step_shape).
"""

from __future__ import annotations

from kvtune.loadgen.locustfiles.step_shape import StepShape

__all__ = ["StepShape"]
