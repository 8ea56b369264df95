"""The chart's autoscaling on any of the engine gauges kvtune.observability.scaling_signal names: the query
KEDA runs is `scaling_query`'s, character for character, and a real Prometheus answers it as a rising gauge
crosses the threshold; the HPA reads the adapter's name for the signal; thresholds the signal can never
reach, bad windows and the removed keys are refused naming the fix.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvtune.engine import free_port, port_in_use
from kvtune.helm import removed_keys
from kvtune.helm.autoscaling import CEILINGS
from kvtune.helm.values import PROMETHEUS_WINDOW, ChartValues
from kvtune.observability.prometheus_server import PrometheusServer, ScrapeTarget
from kvtune.observability.scaling_signal import SIGNAL_NAMES, SIGNALS, SignalName, scaling_query
from tests import k8s_validation
from tests.helm_chart import (
    NAMESPACE,
    RELEASE,
    at_path,
    manifests,
    one,
    pod_matchers,
    render_error,
    scaled_object_query,
)
from tests.hostile_servers import HostileServer, vllm_metrics

FULLNAME = f"{RELEASE}-kvtune"
WINDOWS = st.from_regex(PROMETHEUS_WINDOW, fullmatch=True).filter(lambda window: len(window) <= 8)


def thresholds(signal: SignalName) -> st.SearchStrategy[float]:
    """Thresholds the signal can reach: above 0, at most its ceiling (or a large request count)."""
    return st.floats(min_value=0, max_value=CEILINGS.get(signal, 1e6), exclude_min=True, allow_nan=False)


# ---- the query is scaling_query's ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(signal=st.sampled_from(SIGNAL_NAMES), window=WINDOWS, data=st.data())
def test_the_scaled_object_queries_exactly_what_scaling_query_renders(
    signal: SignalName, window: str, data: st.DataObject
) -> None:
    threshold = data.draw(thresholds(signal))
    query, written = scaled_object_query(
        {"autoscaling": {"signal": signal, "window": window, "keda": {"threshold": threshold}}}
    )
    assert query == scaling_query(signal, pod_matchers(), window)
    assert float(written) == threshold, "KEDA's decimal string is the threshold, not a rounding of it"


def _one_engine_per_signal(scaler: str, setting: str) -> dict[str, Any]:
    """Values of three engines, one per signal (an item of `engines` picks its own), SCALER enabled on each
    at a threshold its signal reaches."""
    engines = [
        {
            "name": name.replace("_", "-"),
            "engine": {
                "model": "Qwen/Qwen2.5-7B-Instruct",
                "servedModelName": f"model-{name}".replace("_", "-"),
            },
            "autoscaling": {
                "signal": name,
                "window": "30s",
                scaler: {"enabled": True, setting: REACHABLE[name]},
            },
        }
        for name in SIGNAL_NAMES
    ]
    return {"engines": engines}


REACHABLE: dict[SignalName, float] = {name: min(4.0, CEILINGS.get(name, 4.0) * 0.8) for name in SIGNAL_NAMES}


def test_each_signal_s_scaled_object_and_hpa_validate_against_their_schemas() -> None:
    keda = manifests(_one_engine_per_signal("keda", "threshold"))
    hpa = manifests(_one_engine_per_signal("hpa", "target"), name="other")
    for name in SIGNAL_NAMES:
        fullname = f"{FULLNAME}-{name.replace('_', '-')}"
        (trigger,) = one(keda, "ScaledObject", fullname)["spec"]["triggers"]
        assert trigger["metricType"] == "AverageValue", "the threshold is per replica"
        assert trigger["metadata"]["query"] == scaling_query(name, pod_matchers(fullname), "30s")
        assert float(trigger["metadata"]["threshold"]) == REACHABLE[name]
        (metric,) = one(hpa, "HorizontalPodAutoscaler", f"other-kvtune-{name.replace('_', '-')}")["spec"][
            "metrics"
        ]
        assert metric["pods"]["metric"]["name"] == SIGNALS[name].adapter_metric
    report = k8s_validation.validate_all(keda + hpa)
    assert set(report) == {k8s_validation.doc_key(doc) for doc in keda + hpa}, "every object validated"
    assert not k8s_validation.failures(report), k8s_validation.failures(report)


@pytest.mark.parametrize("signal", SIGNAL_NAMES)
def test_the_hpa_reads_the_signal_as_the_adapter_names_it(signal: SignalName) -> None:
    target = min(3.5, CEILINGS.get(signal, 3.5) * 0.75)
    autoscaling = {"signal": signal, "hpa": {"enabled": True, "target": target}}
    (metric,) = one(manifests({"autoscaling": autoscaling}), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == SIGNALS[signal].adapter_metric
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": str(target)}
    named = {"signal": signal, "hpa": {"enabled": True, "target": target, "metricName": "site_queue"}}
    (metric,) = one(manifests({"autoscaling": named}), "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "site_queue", "a metricName of the user's adapter wins"


# ---- refusals --------------------------------------------------------------------------------------------

RENAMED = {
    "autoscaling.keda.thresholdWaiting": "autoscaling.keda.threshold",
    "autoscaling.hpa.targetAverageWaiting": "autoscaling.hpa.target",
}


@pytest.mark.parametrize("at_item", [False, True], ids=["top-level", "engines-item"])
@pytest.mark.parametrize("old", sorted(RENAMED))
def test_the_removed_keys_are_refused_naming_their_replacement(old: str, at_item: bool) -> None:
    assert old in {key.path for key in removed_keys.REMOVED_KEYS}
    values = at_path(old, 4)
    if at_item:
        values = {"engines": [{"name": "a", **values}]}
    message = render_error(values)
    prefix = "engines[a]." if at_item else ""
    assert f"{prefix}{old} was removed in chart 0.3.0" in message, message
    assert RENAMED[old] in message, message


@pytest.mark.parametrize(
    ("autoscaling", "setting"),
    [
        ({"keda": {"enabled": True}}, "autoscaling.keda.threshold 4 "),  # the default, meant for requests
        ({"keda": {"enabled": True, "threshold": 1.01}}, "autoscaling.keda.threshold 1.01 "),
        ({"hpa": {"enabled": True, "target": 2}}, "autoscaling.hpa.target 2 "),
    ],
)
def test_a_kv_usage_threshold_above_one_is_refused_by_the_chart_and_the_model(
    autoscaling: dict[str, Any], setting: str
) -> None:
    values = {"autoscaling": {"signal": "kv_usage", **autoscaling}}
    for message in (
        render_error(values),
        render_error({"engines": [{"name": "a", **values}]}),
    ):
        assert setting in message and "never exceeds 1" in message and "such as 0.8" in message, message
    with pytest.raises(ValidationError, match=setting.strip()):
        ChartValues.model_validate({"engine": {"model": "m"}, **values})


@settings(max_examples=60, deadline=None)
@given(
    signal=st.sampled_from(SIGNAL_NAMES),
    threshold=st.floats(min_value=0.01, max_value=50, allow_nan=False),
    kind=st.sampled_from(["keda", "hpa"]),
    enabled=st.booleans(),
)
def test_the_model_refuses_exactly_the_unreachable_thresholds_of_an_enabled_scaler(
    signal: SignalName, threshold: float, kind: str, enabled: bool
) -> None:
    key = "threshold" if kind == "keda" else "target"
    values = {
        "engine": {"model": "m"},
        "autoscaling": {"signal": signal, kind: {"enabled": enabled, key: threshold}},
    }
    unreachable = enabled and threshold > CEILINGS.get(signal, math.inf)
    try:
        ChartValues.model_validate(values)
    except ValidationError as exc:
        assert unreachable, exc
        assert f"autoscaling.{kind}.{key}" in str(exc)
    else:
        assert not unreachable


def test_a_kv_usage_threshold_of_one_and_a_disabled_scaler_s_are_accepted() -> None:
    query, threshold = scaled_object_query({"autoscaling": {"signal": "kv_usage", "keda": {"threshold": 1}}})
    assert threshold == "1" and "vllm:kv_cache_usage_perc" in query
    # The HPA's target is off: the KEDA path does not have to fix it too.
    assert (
        scaled_object_query(
            {"autoscaling": {"signal": "kv_usage", "keda": {"threshold": 0.8}, "hpa": {"target": 4}}}
        )[1]
        == "0.8"
    )


@pytest.mark.parametrize("window", ["1m30s", "0s", "01m", "1d", "60", "-1m", "1.5m", "", "5 m", "1M", "m"])
def test_a_window_that_is_not_a_simple_prometheus_duration_is_refused_by_the_schema(window: str) -> None:
    message = render_error({"autoscaling": {"window": window}})
    assert "/autoscaling/window" in message and "schema" in message, message


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"autoscaling": {"signal": "queue"}}, "/autoscaling/signal"),
        ({"autoscaling": {"keda": {"threshold": 0}}}, "/autoscaling/keda/threshold"),
        ({"autoscaling": {"hpa": {"target": -1}}}, "/autoscaling/hpa/target"),
        ({"autoscaling": {"keda": {"threshold": "4"}}}, "/autoscaling/keda/threshold"),
    ],
)
def test_a_bad_signal_or_threshold_is_refused_by_the_schema(values: dict[str, Any], named: str) -> None:
    message = render_error(values)
    assert named in message and "schema" in message, message


# ---- a real Prometheus answers the rendered query --------------------------------------------------------

SCRAPE_S = 1.0
WINDOW = "10s"
# Each signal's gauge before and after the load rises, and the threshold per replica between them.
RISES: dict[SignalName, tuple[str, str, float]] = {
    "waiting": ("1", "9", 4),
    "running": ("2", "12", 6),
    "kv_usage": ("0.3", "0.95", 0.8),
}
DEADLINE_S = 40.0


@dataclass(frozen=True)
class PodTarget(ScrapeTarget):
    """A scrape target labelled as Prometheus' Kubernetes discovery labels a pod: namespace and pod."""

    namespace: str = NAMESPACE
    pod: str = ""

    @property
    def labels(self) -> dict[str, str]:
        return {"namespace": self.namespace, "pod": self.pod}


def _metrics(level: int) -> Any:
    """The fake engine's /metrics with every signal's gauge at LEVEL (0 before the rise, 1 after)."""
    return vllm_metrics(
        waiting=RISES["waiting"][level], running=RISES["running"][level], kv_usage=RISES["kv_usage"][level]
    )


def _answer(url: str, query: str) -> float | None:
    body = httpx.get(f"{url}/api/v1/query", params={"query": query}, timeout=5).json()
    assert body["status"] == "success", body
    result = body["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _window_filled(url: str, samples: int = 3) -> bool:
    counts = [
        _answer(url, f"count_over_time({SIGNALS[name].metric}{{{pod_matchers()}}}[{WINDOW}])")
        for name in RISES
    ]
    return all(count is not None and count >= samples for count in counts)


def test_prometheus_answers_the_rendered_query_across_the_threshold_as_the_gauge_rises(
    tmp_path: Path,
) -> None:
    rendered = {
        name: scaled_object_query(
            {"autoscaling": {"signal": name, "window": WINDOW, "keda": {"threshold": RISES[name][2]}}}
        )
        for name in RISES
    }
    with HostileServer() as engine, HostileServer() as others:
        engine.route("/metrics", _metrics(0))
        # Pods the matchers must leave out, at far more than any threshold: another namespace's engine of
        # the same name, and another Deployment of the release.
        others.route("/metrics", vllm_metrics(waiting="100", running="100", kv_usage="1"))
        targets: list[ScrapeTarget] = [
            PodTarget("engine", "127.0.0.1", engine.port, pod=f"{FULLNAME}-5d8f7c9b6-x2x7q"),
            PodTarget(
                "other-ns", "127.0.0.1", others.port, namespace="other", pod=f"{FULLNAME}-5d8f7c9b6-abcde"
            ),
            PodTarget("locust", "127.0.0.1", others.port, pod=f"{FULLNAME}-locust-master-5d8f7c9b6-abcde"),
        ]
        port = free_port()
        server = PrometheusServer(
            targets, "groups: []\n", tmp_path / "prometheus", port=port, interval_s=SCRAPE_S
        )
        with server:
            for window in ("500ms", "1h"):  # windows the schema admits are ranges Prometheus parses
                _answer(server.url, scaling_query("waiting", pod_matchers(), window))
            deadline = time.monotonic() + DEADLINE_S
            # The window filled with the low level first (a few scrapes).
            while not _window_filled(server.url):
                assert time.monotonic() < deadline, server.log_path.read_text()[-2000:]
                time.sleep(0.2)
            for name, (query, threshold) in rendered.items():
                answer = _answer(server.url, query)
                assert answer is not None and answer < float(threshold), (name, query, answer)
            engine.route("/metrics", _metrics(1))
            seen: dict[SignalName, list[float]] = {name: [] for name in RISES}
            while not all(seen[name] and seen[name][-1] > float(rendered[name][1]) for name in RISES):
                assert time.monotonic() < deadline, seen
                for name, (query, _threshold) in rendered.items():
                    answer = _answer(server.url, query)
                    assert answer is not None, name
                    seen[name].append(answer)
                time.sleep(0.2)
        assert not port_in_use("127.0.0.1", port), "Prometheus was stopped"
    for name, answers in seen.items():
        low, high = (float(level) for level in RISES[name][:2])
        # The window averages: between the two levels the answer passed through values in between.
        assert any(low < answer < high for answer in answers), (name, answers)
