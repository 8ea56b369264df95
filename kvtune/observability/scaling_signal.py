"""The engine gauges an autoscaler can scale a tuned engine on, in one home: the capacity plan picks one from
what the sweep measured (`kvtune plan`), the chart's ScaledObject and HPA query it, and the load results
record its time mean over each measured window, so the threshold a plan derives and the figure the
autoscaler compares it with are the same statistic of the same series.

KEDA's Prometheus trigger (metricType AverageValue) asks for ceil(query / threshold) replicas, so the query
sums the signal over the engine's pods and the threshold is what ONE replica carries while meeting the SLO.
The query averages each pod's gauge over a window (`avg_over_time`): a load step's figure is the mean of
the gauge sampled through the step, and an instantaneous gauge jumps with every Poisson burst.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtune import metrics

SignalName = Literal["waiting", "running", "kv_usage"]


@dataclass(frozen=True)
class ScalingSignal:
    name: SignalName
    metric: str = ""
    # The EngineDeltas field holding the gauge's time mean over a measured window.
    mean_field: str = ""
    # The name a custom-metrics adapter (prometheus-adapter's default rule: ':' becomes '_') serves it as,
    # for the HPA path.
    adapter_metric: str = ""
    meaning: str = ""
    unit: str = ""


SIGNALS: dict[SignalName, ScalingSignal] = {
    "waiting": ScalingSignal(
        "waiting",
        metrics.REQUESTS_WAITING,
        "mean_waiting",
        "vllm_num_requests_waiting",
        "requests queued for a batch slot or KV room",
        "requests",
    ),
    "running": ScalingSignal(
        "running",
        metrics.REQUESTS_RUNNING,
        "mean_running",
        "vllm_num_requests_running",
        "requests in the running batch",
        "requests",
    ),
    "kv_usage": ScalingSignal(
        "kv_usage",
        metrics.KV_CACHE_USAGE,
        "mean_kv_usage",
        "vllm_kv_cache_usage_perc",
        "share of the KV pool in use (0-1)",
        "",
    ),
}
DEFAULT_SIGNAL: SignalName = "waiting"
SIGNAL_NAMES: tuple[SignalName, ...] = tuple(SIGNALS)


def scaling_query(signal: SignalName, pod_matchers: str, window: str) -> str:
    """The PromQL an autoscaler reads: the signal's per-pod mean over `window`, summed over the pods that
    `pod_matchers` (the label matchers inside the braces) select."""
    return f"sum(avg_over_time({SIGNALS[signal].metric}{{{pod_matchers}}}[{window}]))"
