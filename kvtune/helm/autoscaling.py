"""The chart's autoscaling signals, from kvtune.observability.scaling_signal: the table its ScaledObject and
HPA templates read (templates/_generated.tpl, written by kvtune.helm.build) and the most one replica's signal
can reach, which a threshold above could never be.

The ScaledObject's query is `scaling_query` itself, rendered once here with placeholders the template swaps
for the engine's pod matchers and the window, so the chart and the plan's threshold read one statistic.
"""

from __future__ import annotations

from typing import Any

from kvtune.observability.scaling_signal import SIGNALS, SignalName, scaling_query

MATCHERS_PLACEHOLDER = "__KVTUNE_POD_MATCHERS__"
WINDOW_PLACEHOLDER = "__KVTUNE_WINDOW__"

# The most one replica's signal can be. vLLM's kv_cache_usage_perc is a share of the KV pool, 0 to 1 despite
# its name: a threshold above 1 is never reached, and the autoscaler would never add a replica. Request
# counts have no such bound.
CEILINGS: dict[SignalName, float] = {"kv_usage": 1.0}


def ceiling_problem(signal: SignalName, setting: str, value: float) -> str | None:
    """Why VALUE of SETTING (a threshold per replica) can never be reached on SIGNAL, or None."""
    ceiling = CEILINGS.get(signal)
    if ceiling is None or value <= ceiling:
        return None
    return (
        f"{setting} {value:g} with autoscaling.signal {signal}, the {SIGNALS[signal].meaning}: one replica's "
        f"never exceeds {ceiling:g}, so the autoscaler would never scale out; set {setting} to the share per "
        "replica to scale at (such as 0.8)"
    )


def template_table() -> dict[str, dict[str, Any]]:
    """Each signal as the templates read it: the query with placeholders, the adapter's metric name and
    the ceiling (null when none)."""
    table: dict[str, dict[str, Any]] = {}
    for name, signal in SIGNALS.items():
        query = scaling_query(name, MATCHERS_PLACEHOLDER, WINDOW_PLACEHOLDER)
        if query.count(MATCHERS_PLACEHOLDER) != 1 or query.count(WINDOW_PLACEHOLDER) != 1:
            raise RuntimeError(f"scaling_query({name!r}) no longer holds each placeholder once: {query}")
        table[name] = {
            "query": query,
            "adapterMetric": signal.adapter_metric,
            "meaning": signal.meaning,
            "ceiling": CEILINGS.get(name),
        }
    return table
