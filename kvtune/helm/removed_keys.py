"""Chart values that were removed, each with what replaces it: the one home of that table.

A values file written for an older chart names them; the schema lets them through (an unknown key would be
refused with no word of what replaced it) and templates/checks.yaml refuses each with its replacement, read
from templates/_generated.tpl, where kvtune.helm.build writes this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RemovedKey:
    path: str  # dotted, from the values' top (or an item of `engines`)
    removed_in: str  # the chart version that no longer reads it
    replacement: str  # what to write instead


REMOVED_KEYS: tuple[RemovedKey, ...] = (
    RemovedKey(
        path="gpusPerEngine",
        removed_in="0.2.0",
        replacement="the GPU count is engine.tensorParallelSize x pipelineParallelSize x dataParallelSize "
        "(one GPU per rank), and the chart sets the limit itself; remove gpusPerEngine and set the parallel "
        "sizes",
    ),
    RemovedKey(
        path="autoscaling.keda.thresholdWaiting",
        removed_in="0.3.0",
        replacement="the scaler reads the gauge autoscaling.signal names (waiting by default); write the "
        "number as autoscaling.keda.threshold",
    ),
    RemovedKey(
        path="autoscaling.hpa.targetAverageWaiting",
        removed_in="0.3.0",
        replacement="the scaler reads the gauge autoscaling.signal names (waiting by default); write the "
        "number as autoscaling.hpa.target",
    ),
)


def template_table() -> list[dict[str, str]]:
    return [
        {"path": key.path, "removedIn": key.removed_in, "replacement": key.replacement}
        for key in REMOVED_KEYS
    ]


def schema_property(key: RemovedKey) -> dict[str, object]:
    """The schema's entry for a removed key: admitted, so the chart's own refusal can say what replaces it."""
    return {
        "deprecated": True,
        "description": f"Removed in chart {key.removed_in}: {key.replacement}. Refused when set.",
    }
