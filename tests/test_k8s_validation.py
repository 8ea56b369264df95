"""The manifest validators themselves, on hand-written manifests."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from tests import k8s_validation as kv

pytestmark = pytest.mark.timeout(300)

LABELS = {"app.kubernetes.io/name": "kvtune"}


def deployment() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "kvtune", "labels": LABELS},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "containers": [
                        {
                            "name": "vllm",
                            "image": "vllm/vllm-openai:v0.11.0",
                            "args": ["--port", "8000"],
                            "ports": [{"name": "http", "containerPort": 8000}],
                            "resources": {"limits": {"cpu": "4", "memory": "16Gi"}},
                            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
                        }
                    ]
                },
            },
        },
    }


def hpa() -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "kvtune"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "kvtune"},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": "vllm:num_requests_waiting"},
                        "target": {"type": "AverageValue", "averageValue": "5"},
                    },
                }
            ],
        },
    }


def service_monitor() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "kvtune"},
        "spec": {
            "selector": {"matchLabels": LABELS},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
        },
    }


def prometheus_rule() -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "kvtune"},
        "spec": {
            "groups": [
                {
                    "name": "kvtune",
                    "rules": [
                        {
                            "alert": "KvtuneQueueBacklog",
                            "expr": "sum(vllm:num_requests_waiting) > 10",
                            "for": "5m",
                            "labels": {"severity": "warning"},
                        }
                    ],
                }
            ]
        },
    }


def scaled_object() -> dict[str, Any]:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "kvtune"},
        "spec": {
            "scaleTargetRef": {"name": "kvtune"},
            "minReplicaCount": 1,
            "maxReplicaCount": 4,
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {
                        "serverAddress": "http://prometheus:9090",
                        "query": "sum(vllm:num_requests_waiting)",
                        "threshold": "5",
                    },
                }
            ],
        },
    }


def http_route() -> dict[str, Any]:
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "kvtune"},
        "spec": {
            "parentRefs": [{"name": "inference-gateway"}],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                    "backendRefs": [
                        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "kvtune"}
                    ],
                }
            ],
        },
    }


def inference_pool() -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "kvtune"},
        "spec": {
            "selector": {"matchLabels": LABELS},
            "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "kvtune-epp", "port": {"number": 9002}},
        },
    }


def errors_of(doc: dict[str, Any]) -> list[str]:
    report = kv.validate_all([doc])
    assert list(report) == [kv.doc_key(doc)], report
    return report[kv.doc_key(doc)]


def assert_names(errors: list[str], field: str) -> None:
    assert errors, f"expected an error naming {field}"
    assert any(field in e for e in errors), errors


def test_versions_are_stated() -> None:
    assert kubernetes_validate.latest_version() == kv.KUBERNETES_VERSION
    assert set(kv.CRD_PACKAGES) >= {
        "@kubernetes-models/prometheus-operator",
        "@kubernetes-models/keda",
        "@kubernetes-models/gateway-api",
        "@kubernetes-models/crd-generate",
    }
    assert all(v[0].isdigit() and "^" not in v and "~" not in v for v in kv.CRD_PACKAGES.values())


def test_ensure_node_modules_is_idempotent() -> None:
    first = kv.ensure_node_modules()
    assert (first / "@kubernetes-models" / "keda").is_dir()
    assert kv.GENERATED_VALIDATOR.is_file()
    assert kv.ensure_node_modules() == first


@pytest.mark.parametrize("make", [deployment, hpa])
def test_valid_core_objects_pass(make: Any) -> None:
    assert errors_of(make()) == []


def test_core_misspelled_field_is_named() -> None:
    doc = deployment()
    doc["spec"]["replica"] = doc["spec"].pop("replicas")
    errors = errors_of(doc)
    assert_names(errors, "replica")
    assert errors[0].startswith("spec:"), errors


def test_core_wrong_type_is_named() -> None:
    doc = deployment()
    doc["spec"]["replicas"] = "two"
    assert_names(errors_of(doc), "spec.replicas")


def test_core_nested_unknown_field_is_named() -> None:
    doc = deployment()
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    assert_names(errors_of(doc), "imagePullPolice")


def test_core_unknown_api_version_is_an_error() -> None:
    doc = hpa()
    doc["apiVersion"] = "autoscaling/v2beta2"
    assert_names(errors_of(doc), "no schema for autoscaling/v2beta2 HorizontalPodAutoscaler")


def test_validate_core_skips_custom_resources() -> None:
    assert kv.validate_core([service_monitor(), deployment()]) == {"Deployment/kvtune": []}


def test_validate_custom_skips_core_kinds() -> None:
    assert kv.validate_custom([deployment(), service_monitor()]) == {"ServiceMonitor/kvtune": []}


VALID_CUSTOM = [service_monitor, prometheus_rule, scaled_object, http_route, inference_pool]


@pytest.mark.parametrize("make", VALID_CUSTOM)
def test_valid_custom_resources_pass(make: Any) -> None:
    assert errors_of(make()) == []


def _set(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Copy of doc with the dotted path (list indexes as numbers) set to value, or removed."""
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    key: Any = int(last) if last.isdigit() else last
    if value is _REMOVE:
        del node[key]
    else:
        node[key] = value
    return doc


_REMOVE = object()

INVALID_CUSTOM = [
    # (manifest, path to change, new value, text the error must contain)
    (service_monitor, "spec.endpoints.0.port", 8000, "spec.endpoints[0].port"),
    (service_monitor, "spec.endpoints.0.interval", "15 seconds", "spec.endpoints[0].interval"),
    (service_monitor, "spec", _REMOVE, "spec: required"),
    (prometheus_rule, "spec.groups.0.rules.0.expr", _REMOVE, "spec.groups[0].rules[0].expr"),
    (prometheus_rule, "spec.groups.0.rules.0.for", "five minutes", "spec.groups[0].rules[0].for"),
    (scaled_object, "spec.minReplicaCount", "1", "spec.minReplicaCount"),
    (scaled_object, "spec.triggers", _REMOVE, "spec.triggers"),
    (http_route, "spec.rules.0.matches.0.path.type", "Prefix", "spec.rules[0].matches[0].path.type"),
    (http_route, "spec.parentRefs.0.port", "http", "spec.parentRefs[0].port"),
    (inference_pool, "spec.targetPorts", _REMOVE, "spec.targetPorts"),
    (inference_pool, "spec.targetPorts", [], "spec.targetPorts"),
    (inference_pool, "spec.targetPorts.0.number", "8000", "spec.targetPorts[0].number"),
    (inference_pool, "spec.targetPorts.0.number", 70000, "spec.targetPorts[0].number"),
    (inference_pool, "spec.targetPorts", [{"number": 8000}, {"number": 8000}], "port number must be unique"),
    (inference_pool, "spec.selector.matchLabels", _REMOVE, "spec.selector.matchLabels"),
    (inference_pool, "spec.endpointPickerRef.port", _REMOVE, "port is required"),
    (inference_pool, "spec.endpointPickerRef.failureMode", "Open", "spec.endpointPickerRef.failureMode"),
    (inference_pool, "spec.endpointPickerRef.port.numbr", 9002, "spec.endpointPickerRef.port"),
    (inference_pool, "spec.targetPort", [{"number": 8000}], "spec.targetPort: unknown field"),
]


@pytest.mark.parametrize(
    ("make", "path", "value", "expected"),
    INVALID_CUSTOM,
    ids=[f"{m.__name__}-{p}-{e}" for m, p, _, e in INVALID_CUSTOM],
)
def test_invalid_custom_resources_fail(make: Any, path: str, value: Any, expected: str) -> None:
    assert_names(errors_of(_set(make(), path, value)), expected)


def test_inference_pool_endpoint_picker_port_is_optional_for_other_kinds() -> None:
    doc = _set(
        inference_pool(), "spec.endpointPickerRef", {"group": "example.com", "kind": "Picker", "name": "p"}
    )
    assert errors_of(doc) == []


def test_unknown_custom_kind_is_reported() -> None:
    doc = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    assert errors_of(doc) == ["no schema for example.com/v1 Widget"]


def test_gateway_group_is_not_mistaken_for_a_builtin_one() -> None:
    doc = _set(http_route(), "kind", "NoSuchRoute")
    assert errors_of(doc) == ["no schema for gateway.networking.k8s.io/v1 NoSuchRoute"]


def test_validate_all_covers_every_doc_once() -> None:
    docs = [deployment(), hpa(), service_monitor(), prometheus_rule(), scaled_object(), http_route()]
    docs.append(inference_pool())
    docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kvtune"}, "data": {"a": "b"}})
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kvtune"},
            "spec": {"ports": [{"port": 8000}]},
        }
    )
    report = kv.validate_all(docs)
    assert sorted(report) == sorted(kv.doc_key(d) for d in docs)
    assert kv.failures(report) == {}


def test_validate_all_reports_duplicates_and_missing_names() -> None:
    nameless = deployment()
    del nameless["metadata"]["name"]
    report = kv.validate_all([deployment(), deployment(), nameless])
    assert_names(report["Deployment/kvtune"], "appears more than once")
    assert_names(report["Deployment/<no name>"], "metadata.name")
