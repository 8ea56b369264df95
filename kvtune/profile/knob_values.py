"""A profile with some fields set to other values, as a sweep's trial or winner sets its knobs: setting one
KV budget replaces the other, as a user switching budgets would expect."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from kvtune.profile.model import EngineProfile

# The two ways to size the KV pool: a profile sets at most one.
_OTHER_BUDGET = {
    "kv_cache_memory_bytes": "gpu_memory_utilization",
    "gpu_memory_utilization": "kv_cache_memory_bytes",
}


def with_knobs(data: dict[str, Any], knobs: dict[str, Any]) -> dict[str, Any]:
    """A profile's fields (as model_dump gives them) with KNOBS set."""
    data = dict(data)
    for knob, value in knobs.items():
        data[knob] = value
        if knob in _OTHER_BUDGET:
            data[_OTHER_BUDGET[knob]] = None
    return data


def applied(base: EngineProfile, knobs: dict[str, Any]) -> EngineProfile:
    """BASE with KNOBS set, validated as any profile is (ValidationError when the result is not one)."""
    return type(base).model_validate(with_knobs(base.model_dump(), knobs))


def problem(base: EngineProfile, knobs: dict[str, Any]) -> str | None:
    """Why BASE with KNOBS set is not a valid profile; None when it is."""
    try:
        applied(base, knobs)
    except ValidationError as exc:
        return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
    return None
