"""Which repeat of a config and which of its load steps the report shows, and the KV figures read there.

The configs table (report.py) and the KV plot (plots.py) both describe a config by the same step, so they
take it from here.
"""

from __future__ import annotations

from kvtune.sweep.records import StepRecord, TrialRecord


def representative(trials: list[TrialRecord]) -> TrialRecord:
    """The repeat a config's row describes: an eligible one if any, else a measured one, else the first."""
    eligible = [t for t in trials if t.eligible]
    measured = [t for t in trials if t.status == "done"]
    return (eligible or measured or trials)[0]


def telling_step(trial: TrialRecord) -> StepRecord | None:
    """The step at goodput, or the first missed step when none passed."""
    return trial.best_step or next((s for s in trial.steps if not s.passed), None)


def kv_tokens(trial: TrialRecord, step: StepRecord | None) -> int | None:
    capacity = trial.kv_capacity or (step.result.engine.kv_capacity if step else None) or {}
    tokens = capacity.get("tokens")
    return int(tokens) if tokens else None


def worst_preemptions(trial: TrialRecord) -> tuple[float, StepRecord | None]:
    """The most preemptions any one step of `trial` saw, and that step."""
    step = max(trial.steps, key=lambda s: s.result.engine.preemptions, default=None)
    return (step.result.engine.preemptions, step) if step else (0.0, None)
