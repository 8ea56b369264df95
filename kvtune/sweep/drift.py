"""Did the host change under the sweep? Two checks on what the trials measured.

- A contradiction: two configs that differ only in the KV pool's size, where the larger pool scored a lower
  goodput and saw no preemptions. A larger pool with the same batch limits cannot serve less unless
  something engine-side (preemptions) or the host changed; the larger one is measured again.
- A sentinel: the first config measured is measured again at the end, at the rate of its goodput step with
  the same seed, and its median latencies compared with the first time. Verdicts decided closer to their
  target than that drift are named as in doubt.
"""

from __future__ import annotations

from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvtune.sweep.records import DRIFT_NOISE, DriftCheck, StepRecord, TrialRecord

# The knobs that only size the KV pool: configs equal in every other knob share their batch limits.
POOL_KNOBS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")


_BYTES = TypeAdapter(ByteSize)


def _pool_size(knobs: dict[str, Any]) -> tuple[str, float] | None:
    """The one pool knob a config sets and its size ('1GiB' read as bytes); None when not exactly one."""
    sized = [knob for knob in POOL_KNOBS if knob in knobs]
    if len(sized) != 1:
        return None
    value = knobs[sized[0]]
    try:
        return sized[0], float(_BYTES.validate_python(value) if isinstance(value, str) else value)
    except (ValidationError, TypeError, ValueError):
        return None


def _preempted(record: TrialRecord) -> bool:
    return any(step.result.engine.preemptions > 0 for step in record.steps)


def contradictions(records: list[TrialRecord]) -> list[tuple[TrialRecord, TrialRecord]]:
    """(larger, smaller) pairs of measured configs where the larger pool scored lower with no preemptions."""
    done = [r for r in records if r.status == "done"]
    found = []
    for larger in done:
        size = _pool_size(larger.knobs)
        if size is None or _preempted(larger):
            continue
        rest = {k: v for k, v in larger.knobs.items() if k != size[0]}
        for smaller in done:
            other = _pool_size(smaller.knobs)
            same_limits = {k: v for k, v in smaller.knobs.items() if k != size[0]} == rest
            smaller_pool = other is not None and other[0] == size[0] and other[1] < size[1]
            if smaller_pool and same_limits and larger.goodput < smaller.goodput:
                found.append((larger, smaller))
    return found


def _relative(before: float | None, after: float | None) -> float | None:
    if before is None or after is None or before <= 0:
        return None
    return abs(after - before) / before


def check(
    sentinel: TrialRecord, again: StepRecord, records: list[TrialRecord], remeasured: list[str]
) -> DriftCheck:
    """Compare the sentinel's step at `again.rate` with `again`, and name the verdicts the drift reaches."""
    first = next(s for s in sentinel.steps if s.rate == again.rate)
    before, after = first.result, again.result
    pairs = ((before.ttft.p50, after.ttft.p50), (before.itl.p50, after.itl.p50))
    changes = [c for b, a in pairs if (c := _relative(b, a)) is not None]
    drift = max(changes) if changes else None
    drifted = drift is not None and drift > DRIFT_NOISE
    return DriftCheck(
        config_id=sentinel.config_id,
        rate=again.rate,
        ttft_p50_before=before.ttft.p50,
        ttft_p50_after=after.ttft.p50,
        itl_p50_before=before.itl.p50,
        itl_p50_after=after.itl.p50,
        drift=drift,
        drifted=drifted,
        in_doubt=in_doubt(records, drift) if drifted and drift is not None else [],
        remeasured=remeasured,
    )


def in_doubt(records: list[TrialRecord], drift: float) -> list[str]:
    """Steps whose deciding bound lies within `drift` of its target: the same step on the host as it was at
    the other end of the sweep could have been decided the other way."""
    doubtful = []
    for record in records:
        for step in record.steps:
            for verdict in step.verdicts:
                if verdict.name == "error rate":
                    continue
                bound = verdict.upper if verdict.decision == "pass" else verdict.lower
                if verdict.decision == "undecided" or bound is None:
                    continue
                if abs(bound - verdict.target) <= drift * verdict.target:
                    doubtful.append(
                        f"{record.config_id} at {step.rate:.3g} req/s ({verdict.name} {verdict.decision}, "
                        f"bound {bound:.3f} s vs {verdict.target:.3f} s)"
                    )
    return doubtful
