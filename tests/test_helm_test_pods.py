"""The chart's `helm test` pods (helm/kvtune/templates/tests/), rendered by Helm's own engine with the chart's
other manifests: test hooks, least privilege, validated against Kubernetes' schemas, the metric names they
want being what kvtune's dashboards and alerts query. Then each pod's check script runs for real, as its pod
runs it (its command, args and env from the rendered manifest), against a fake engine, Locust and Kubernetes
API on 127.0.0.1 that grants only what the chart's test Role grants: it passes on a healthy release and
fails, naming what it saw, on each fault.

No cluster here: a live `helm test` is the README's walk-through (deploy/k8s/check-release.sh runs it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.helm import test_pods as chart_tests
from kvtune.helm.release_checks import cluster_checks
from kvtune.observability.alerts import alert_rules
from tests import k8s_validation
from tests.helm_chart import CHART, NAMESPACE, RELEASE, lint, load_values, manifests

FULLNAME = f"{RELEASE}-kvtune"
CPU_SMOKE = load_values(CHART / "values-cpu-smoke.yaml")
API_KEY = {"engine": {"apiKeySecret": {"name": "engine-key", "key": "api-key"}}}
# Every optional object the objects pod checks (PodMonitor and HPA are the alternatives, in ALTERNATIVES).
OBJECTS_ON: dict[str, Any] = {
    "monitoring": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
        "dashboards": {"enabled": True},
    },
    "autoscaling": {"keda": {"enabled": True}},
    "inferencePool": {
        "enabled": True,
        "endpointPicker": {"serviceName": "kvtune-epp"},
        "httpRoute": {"enabled": True, "gatewayName": "inference-gateway"},
    },
    "locust": {"enabled": True, "workers": 2},
}
ALTERNATIVES: dict[str, Any] = {
    "monitoring": {"podMonitor": {"enabled": True}},
    "autoscaling": {"hpa": {"enabled": True}},
}
VALUE_SETS: dict[str, list[dict[str, Any]]] = {
    "defaults": [],
    "api-key": [API_KEY],
    "cpu-smoke": [CPU_SMOKE],
    "everything": [CPU_SMOKE, API_KEY, OBJECTS_ON],
    "alternatives": [ALTERNATIVES],
}
EXPECTED_CHECKS: dict[str, list[str]] = {
    "defaults": ["rollout", "health", "models", "completion", "metrics"],
    "api-key": ["rollout", "health", "models", "api-key", "completion", "metrics"],
    "cpu-smoke": ["rollout", "health", "models", "completion", "metrics", "locust"],
    "everything": ["rollout", "health", "models", "api-key", "completion", "metrics", "objects", "locust"],
    "alternatives": ["rollout", "health", "models", "completion", "metrics", "objects"],
}
KEY = "sk-test-4f1c9a77"  # what the fake Secret holds; no output may show it
TOKEN = "fake-service-account-token"
ENGINE_METRIC = re.compile(r"vllm:[a-zA-Z0-9_:]+")


def hooks_of(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The test hooks among the rendered objects, in the order `helm test` runs them (weight, then name)."""
    hooks = [doc for doc in docs if (doc["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]
    return sorted(hooks, key=lambda doc: (int(doc["metadata"]["annotations"]["helm.sh/hook-weight"]),
                                          doc["metadata"]["name"]))  # fmt: skip


def check_of(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["name"]).removeprefix(f"{FULLNAME}-test-")


def container_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    assert isinstance(container, dict)
    return container


def env_value(pod: dict[str, Any], name: str) -> str:
    (value,) = [item["value"] for item in container_of(pod)["env"] if item["name"] == name]
    return str(value)


def one_pod(docs: list[dict[str, Any]], check: str) -> dict[str, Any]:
    (pod,) = [pod for pod in hooks_of(docs) if check_of(pod) == check]
    return pod


def role_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (role,) = [doc for doc in docs if doc["kind"] == "Role"]
    return role


# ---- rendered with the chart ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_the_test_pods_render_as_test_hooks_and_validate_with_the_chart(name: str) -> None:
    layers = VALUE_SETS[name]
    report = lint(*layers)
    assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"], report
    docs = manifests(*layers)
    pods = hooks_of(docs)
    assert [check_of(pod) for pod in pods] == EXPECTED_CHECKS[name]
    assert all(pod["kind"] == "Pod" for pod in pods), "`helm test --logs` reads every test hook as a pod"
    for pod in pods:
        annotations = pod["metadata"]["annotations"]
        assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
        assert pod["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert pod["spec"]["restartPolicy"] == "Never"
    # Validated with every other object of the release, as one install would send them.
    by_object = k8s_validation.validate_all(docs)
    assert set(by_object) == {k8s_validation.doc_key(doc) for doc in docs}
    assert not k8s_validation.failures(by_object), k8s_validation.failures(by_object)


def test_tests_disabled_render_no_test_pod_and_no_reader() -> None:
    docs = manifests({"tests": {"enabled": False}})
    assert not hooks_of(docs)
    assert not [doc for doc in docs if "-test-" in doc["metadata"]["name"]]


@pytest.mark.parametrize("name", ["defaults", "everything"])
def test_every_test_pod_runs_locked_down_and_small(name: str) -> None:
    for pod in hooks_of(manifests(*VALUE_SETS[name])):
        spec, container = pod["spec"], container_of(pod)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        assert container["resources"] == {
            "requests": {"cpu": "10m", "memory": "32Mi"},
            "limits": {"cpu": "500m", "memory": "128Mi"},
        }
        # Only the pods that read the cluster carry a token, and theirs is the test reader's.
        if check_of(pod) in ("rollout", "objects"):
            assert spec["serviceAccountName"] == f"{FULLNAME}-test-reader"
        else:
            assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
        # The check script, from the chart, with the standard library only.
        assert container["command"][:5] == ["python3", "-I", "-S", "-B", "-c"]
        script = "http_checks.py" if check_of(pod) not in ("rollout", "objects") else "cluster_checks.py"
        assert container["command"][5] == (CHART / "files" / "release-checks" / script).read_text()


def test_the_image_is_the_engine_s_or_kvtune_s() -> None:
    engine = container_of(one_pod(manifests(), "health"))
    assert engine["image"] == "vllm/vllm-openai:v0.33.0"
    cpu = container_of(one_pod(manifests(CPU_SMOKE), "health"))
    assert cpu["image"] == "public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo:v0.32.0"
    kvtune = container_of(one_pod(manifests({"tests": {"image": "kvtune"}}), "health"))
    assert kvtune["image"] == "ghcr.io/kvtune/kvtune:0.1.0"


def test_the_api_key_comes_from_the_secret_and_only_where_v1_is_called() -> None:
    docs = manifests(API_KEY)
    for pod in hooks_of(docs):
        refs = {
            item["name"]: item["valueFrom"]["secretKeyRef"]
            for item in container_of(pod)["env"]
            if "valueFrom" in item
        }
        if check_of(pod) in ("models", "api-key", "completion"):
            assert refs == {"KVTUNE_API_KEY": {"name": "engine-key", "key": "api-key", "optional": True}}
            assert env_value(pod, "API_KEY_SOURCE") == "key api-key of secret/engine-key"
        else:
            assert refs == {}


def test_the_role_grants_exactly_what_the_checks_read() -> None:
    docs = manifests(*VALUE_SETS["everything"])
    role = role_of(docs)
    assert "annotations" not in role["metadata"], "installed with the release, not a test hook"
    rules = {(rule["apiGroups"][0], rule["resources"][0]): rule for rule in role["rules"]}
    assert all(len(rule["apiGroups"]) == len(rule["resources"]) == 1 for rule in role["rules"])
    rollout_args = container_of(one_pod(docs, "rollout"))["args"]
    assert rollout_args == ["rollout", FULLNAME, f"{FULLNAME}-locust-master", f"{FULLNAME}-locust-worker"]
    deployments = rules.pop(("apps", "deployments"))
    assert deployments == {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "resourceNames": rollout_args[1:],
        "verbs": ["get"],
    }
    assert rules.pop(("", "pods")) == {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}
    objects = json.loads(env_value(one_pod(docs, "objects"), "RELEASE_OBJECTS"))
    assert set(objects) == {
        "serviceMonitor",
        "prometheusRule",
        "dashboards",
        "keda",
        "inferencePool",
        "httpRoute",
    }
    for check, spec in objects.items():
        _kind, api, resource = cluster_checks.OBJECT_KINDS[check]
        group = api.split("/")[1] if api.startswith("apis/") else ""
        rule = rules.pop((group, resource))
        assert rule["verbs"] == ["get"]
        assert rule["resourceNames"] == spec.get("names", [spec.get("name")])
    assert not rules, f"granted and never read: {rules}"
    (binding,) = [doc for doc in docs if doc["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": f"{FULLNAME}-test-reader", "namespace": NAMESPACE}
    ]


def test_the_objects_pod_names_what_the_chart_made() -> None:
    docs = manifests(*VALUE_SETS["everything"])
    objects = json.loads(env_value(one_pod(docs, "objects"), "RELEASE_OBJECTS"))
    made = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    for check, spec in objects.items():
        kind = cluster_checks.OBJECT_KINDS[check][0]
        for name in spec.get("names", [spec.get("name")]):
            assert (kind, name) in made, (check, name)
    dashboards = [
        doc for doc in docs if doc["kind"] == "ConfigMap" and "grafana_dashboard" in doc["metadata"]["labels"]
    ]
    assert sorted(objects["dashboards"]["names"]) == sorted(doc["metadata"]["name"] for doc in dashboards)
    rules = yaml.safe_load((CHART / "files" / "kvtune-alerts.yaml").read_text())["groups"]
    assert objects["prometheusRule"]["alerts"] == {
        group["name"]: [rule["alert"] for rule in group["rules"] if "alert" in rule] for group in rules
    }


# ---- the metric names -----------------------------------------------------------------------------------


def names_in(node: Any) -> set[str]:
    """The vLLM metric names in every "expr" of a JSON model (a dashboard as Grafana imports it)."""
    if isinstance(node, dict):
        return set().union(*(ENGINE_METRIC.findall(v) if k == "expr" and isinstance(v, str) else names_in(v)
                             for k, v in node.items()))  # fmt: skip
    if isinstance(node, list):
        return set().union(*(names_in(item) for item in node))
    return set()


# vLLM exports these only with --kv-cache-metrics (residency), or from the offload tier's first transfer.
RESIDENCY = re.compile(r"vllm:kv_block_")
OFFLOAD = re.compile(r"vllm:kv_offload_")


def test_the_metrics_pod_wants_every_name_the_dashboards_and_alerts_query() -> None:
    """Every name the engine exports whatever its values; the residency histograms only when
    engine.kvCacheMetrics turns them on; the offload tier's never (no sample before its first transfer)."""
    wanted = container_of(one_pod(manifests(), "metrics"))["args"][1:]
    with_residency = container_of(one_pod(manifests({"engine": {"kvCacheMetrics": True}}), "metrics"))[
        "args"
    ][1:]
    # From the dashboards and rules the chart ships, read here independently of kvtune.helm.test_pods.
    shipped = [
        json.loads(path.read_text()) for path in sorted((CHART / "files" / "dashboards").glob("*.json"))
    ]
    dashboards = set().union(*(names_in(model) for model in shipped))
    alerts = set(ENGINE_METRIC.findall((CHART / "files" / "kvtune-alerts.yaml").read_text()))
    queried = dashboards | alerts
    residency = {name for name in queried if RESIDENCY.match(name)}
    always = {name for name in queried if not RESIDENCY.match(name) and not OFFLOAD.match(name)}
    assert len(dashboards) > 10 and residency and any(OFFLOAD.match(name) for name in queried)
    assert wanted == sorted(always) == chart_tests.queried_metrics()
    assert sorted(with_residency) == sorted(always | residency)
    assert dashboards == chart_tests.dashboard_metrics()
    assert (CHART / "files" / "release-checks" / "queried-metrics.txt").read_text().split() == wanted


def test_the_chart_s_check_scripts_are_current() -> None:
    for path, text in chart_tests.generated_files(CHART).items():
        assert path.read_text(encoding="utf-8") == text, f"{path} is stale: regenerate the chart's files"


# ---- the checks run for real ----------------------------------------------------------------------------


@dataclass
class FakeRelease:
    """What the fake engine, Locust and API server answer; switch a field to inject a fault."""

    role_rules: list[dict[str, Any]]
    metrics: list[str]
    served: str = "smollm2-135m"
    api_key: str = KEY
    health_status: int = 200
    key_enforced: bool = True
    choices: list[dict[str, Any]] = field(default_factory=lambda: [{"text": " Paris"}])
    missing_metric: str = ""
    locust_stats: bytes = b'{"state": "ready", "user_count": 0, "worker_count": 2}'
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    rolled_out: bool = True
    pods_ready: bool = True
    requests: list[str] = field(default_factory=list)

    def allowed(self, path: str) -> bool:
        """Whether the test Role lets its ServiceAccount GET this path (a get by name or a list)."""
        parts = urllib.parse.urlsplit(path).path.strip("/").split("/")
        group = "" if parts[0] == "api" else parts[1]
        rest = parts[2:] if parts[0] == "api" else parts[3:]
        if len(rest) < 3 or rest[0] != "namespaces" or rest[1] != NAMESPACE:
            return False
        resource, name = rest[2], rest[3] if len(rest) > 3 else None
        verb = "get" if name else "list"
        return any(
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and verb in rule["verbs"]
            and (name is None or "resourceNames" not in rule or name in rule["resourceNames"])
            for rule in self.role_rules
        )


def deployment(name: str, rolled_out: bool) -> dict[str, Any]:
    updated = 1 if rolled_out else 0
    return {
        "metadata": {"name": name, "generation": 2},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 2,
            "replicas": 1,
            "updatedReplicas": updated,
            "availableReplicas": updated,
        },
    }


def live_objects(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Path -> object for each optional object the chart rendered, with a healthy status."""
    active = {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"}
    accepted = {"type": "Accepted", "status": "True", "reason": "Accepted"}
    statuses = {
        "HorizontalPodAutoscaler": {"currentReplicas": 1, "desiredReplicas": 1, "conditions": [active]},
        "ScaledObject": {
            "hpaName": f"keda-hpa-{FULLNAME}",
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "Active", "status": "False"}],
        },
        "HTTPRoute": {"parents": [{"parentRef": {"name": "inference-gateway"}, "conditions": [accepted]}]},
    }
    objects = {}
    for check, (kind, _api, _resource) in cluster_checks.OBJECT_KINDS.items():
        for doc in docs:
            if doc["kind"] == kind and (
                kind != "ConfigMap" or "grafana_dashboard" in doc["metadata"]["labels"]
            ):
                live = json.loads(json.dumps(doc)) | {"status": statuses.get(kind, {})}
                objects[cluster_checks.object_path(check, NAMESPACE, doc["metadata"]["name"])] = live
    return objects


@pytest.fixture
def serve() -> Iterator[Any]:
    """Starts the fake on 127.0.0.1 for a release; stopped after the test."""
    servers: list[ThreadingHTTPServer] = []

    def start(release: FakeRelease) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(release))
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def handler_for(release: FakeRelease) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _keyed(self) -> bool:
            sent = self.headers.get("Authorization", "")
            return not release.key_enforced or sent == f"Bearer {release.api_key}"

        def do_GET(self) -> None:
            release.requests.append(self.path)
            if self.path.startswith(("/api/", "/apis/")):
                self._kubernetes()
            elif self.path == "/health":
                self._send(release.health_status, b"")
            elif self.path == "/v1/models":
                if not self._keyed():
                    self._send(401, {"error": "Unauthorized"})
                else:
                    self._send(200, {"object": "list", "data": [{"id": release.served, "object": "model"}]})
            elif self.path == "/metrics":
                lines = [f'{name}{{engine="0",model_name="{release.served}"}} 0.0' for name in release.metrics
                         if name != release.missing_metric]  # fmt: skip
                self._send(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")
            elif self.path == "/":
                self._send(200, b"<html>Locust</html>", "text/html")
            elif self.path == "/stats/requests":
                self._send(200, release.locust_stats)
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            release.requests.append(self.path)
            if self.path != "/v1/completions" or not self._keyed():
                self._send(401, {"error": "Unauthorized"})
            elif body.get("model") != release.served:
                self._send(404, {"error": f"model {body.get('model')} does not exist"})
            else:
                self._send(200, {"object": "text_completion", "choices": release.choices})

        def _kubernetes(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._send(401, {"kind": "Status", "message": "Unauthorized"})
            elif not release.allowed(self.path):
                self._send(403, {"kind": "Status", "message": f"forbidden: {self.path}"})
            elif "/deployments/" in self.path:
                self._send(200, deployment(self.path.rsplit("/", 1)[1], release.rolled_out))
            elif self.path.startswith(f"/api/v1/namespaces/{NAMESPACE}/pods?"):
                ready = "True" if release.pods_ready else "False"
                pod = {"metadata": {"name": f"{FULLNAME}-5d9f7-abcde"},
                       "status": {"phase": "Running" if release.pods_ready else "Pending",
                                  "conditions": [{"type": "Ready", "status": ready}]}}  # fmt: skip
                self._send(200, {"kind": "PodList", "items": [pod]})
            elif self.path in release.objects:
                self._send(200, release.objects[self.path])
            else:
                self._send(404, {"kind": "Status", "message": f"{self.path} not found"})

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


def run_pod(
    pod: dict[str, Any], url: str, tmp_path: Path, secrets: dict[tuple[str, str], str]
) -> subprocess.CompletedProcess[str]:
    """The pod's container as the kubelet starts it, with the cluster's addresses pointing at the fake."""
    container = container_of(pod)
    env: dict[str, str] = {}
    for item in container["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is None:
            env[item["name"]] = item["value"]
        elif (ref["name"], ref["key"]) in secrets:  # optional: an absent key leaves the variable unset
            env[item["name"]] = secrets[(ref["name"], ref["key"])]
    for name in ("ENGINE_URL", "LOCUST_URL"):
        if name in env:
            env[name] = url
    if pod["spec"].get("serviceAccountName"):
        account = tmp_path / "serviceaccount"
        account.mkdir(exist_ok=True)
        (account / "token").write_text(TOKEN)
        env |= {"KUBERNETES_API": url, "SERVICE_ACCOUNT_DIR": str(account)}
    command = [sys.executable if part == "python3" else part for part in container["command"]]
    return subprocess.run(
        command + container["args"], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def rendered(*layers: dict[str, Any]) -> tuple[list[dict[str, Any]], FakeRelease]:
    docs = manifests(CPU_SMOKE, API_KEY, OBJECTS_ON, *layers)
    release = FakeRelease(
        role_rules=role_of(docs)["rules"],
        metrics=container_of(one_pod(docs, "metrics"))["args"][1:],
        objects=live_objects(docs),
    )
    return docs, release


SECRETS = {("engine-key", "api-key"): KEY}


def test_on_a_healthy_release_every_test_pod_passes(serve: Any, tmp_path: Path) -> None:
    docs, release = rendered()
    url = serve(release)
    outputs = []
    for pod in hooks_of(docs):
        result = run_pod(pod, url, tmp_path, SECRETS)
        assert result.returncode == 0, f"{check_of(pod)}: {result.stdout}{result.stderr}"
        assert result.stdout.startswith("PASS  ") and "FAIL" not in result.stdout and not result.stderr
        outputs.append(result.stdout)
    text = "".join(outputs)
    assert KEY not in text
    for line in (
        f"PASS  rollout: deployment/{FULLNAME} successfully rolled out (1 available)",
        "PASS  engine pods: 1/1 engine pods Ready",
        "PASS  GET /v1/models: lists smollm2-135m",
        "PASS  API key: /v1/models without the key: HTTP 401, with the key from key api-key of "
        "secret/engine-key: HTTP 200",
        "PASS  POST /v1/completions: max_tokens 8: 1 choice(s), text ' Paris'",
        f"PASS  GET /metrics: has all {len(release.metrics)} metrics kvtune's dashboards and alerts query",
        f"PASS  prometheusrule: PrometheusRule demo-kvtune: all {len(alert_rules())} alerts of kvtune's "
        "rules",
        "PASS  httproute: HTTPRoute demo-kvtune: inference-gateway: Accepted=True Accepted",
        "PASS  locust web UI: GET / HTTP 200; GET /stats/requests: state ready, users 0, workers 2",
    ):
        assert line in text, text
    # The engine's Service and Locust's, as the pods reach them in the cluster.
    assert env_value(one_pod(docs, "health"), "ENGINE_URL") == f"http://{FULLNAME}.{NAMESPACE}.svc:8000"
    assert (
        env_value(one_pod(docs, "locust"), "LOCUST_URL") == f"http://{FULLNAME}-locust.{NAMESPACE}.svc:8089"
    )
    assert not [path for path in release.requests if path.startswith("/api") and not release.allowed(path)]


def cut_alert(release: FakeRelease) -> None:
    (path,) = [p for p in release.objects if "/prometheusrules/" in p]
    release.objects[path]["spec"]["groups"][0]["rules"].pop()


def unlabel_dashboard(release: FakeRelease) -> None:
    path = sorted(p for p in release.objects if "/configmaps/" in p)[0]
    del release.objects[path]["metadata"]["labels"]["grafana_dashboard"]


def reject_route(release: FakeRelease) -> None:
    (path,) = [p for p in release.objects if "/httproutes/" in p]
    release.objects[path]["status"]["parents"][0]["conditions"][0] |= {
        "status": "False",
        "reason": "NoMatchingParent",
    }


def lose_keda(release: FakeRelease) -> None:
    (path,) = [p for p in release.objects if "/scaledobjects/" in p]
    del release.objects[path]


def set_field(name: str, value: Any) -> Any:
    return lambda release: setattr(release, name, value)


# fault -> (the pod that must fail, what breaks, what its FAIL line says)
FAULTS: dict[str, tuple[str, Any, str]] = {
    "not rolled out": (
        "rollout",
        set_field("rolled_out", False),
        f"FAIL  rollout: deployment/{FULLNAME} not rolled out after 1s: 0 of 1 new replicas updated",
    ),
    "pod not ready": (
        "rollout",
        set_field("pods_ready", False),
        f"FAIL  engine pods: 0/1 engine pods Ready: not Ready {FULLNAME}-5d9f7-abcde (Pending)",
    ),
    "unhealthy": ("health", set_field("health_status", 503), "FAIL  GET /health: HTTP 503"),
    "model not listed": (
        "models",
        set_field("served", "another-model"),
        "FAIL  GET /v1/models: smollm2-135m not listed; lists another-model",
    ),
    "200 without the key": (
        "api-key",
        set_field("key_enforced", False),
        "FAIL  API key: /v1/models without the key: HTTP 200: ",
    ),
    "wrong key": (
        "api-key",
        set_field("api_key", "another-key"),
        "with the key from key api-key of secret/engine-key: HTTP 401: ",
    ),
    "no choices": ("completion", set_field("choices", []), "FAIL  POST /v1/completions: no choices"),
    "missing metric": (
        "metrics",
        set_field("missing_metric", "vllm:prefix_cache_hits_total"),
        "FAIL  GET /metrics: missing vllm:prefix_cache_hits_total (kvtune's dashboards",
    ),
    "alert missing": (
        "objects",
        cut_alert,
        f"FAIL  prometheusrule: PrometheusRule demo-kvtune: group kvtune lacks {alert_rules()[-1].name}",
    ),
    "dashboard unlabelled": ("objects", unlabel_dashboard, "not labelled grafana_dashboard=1"),
    "route not accepted": (
        "objects",
        reject_route,
        "FAIL  httproute: HTTPRoute demo-kvtune: inference-gateway: Accepted=False NoMatchingParent",
    ),
    "scaled object gone": (
        "objects",
        lose_keda,
        "FAIL  keda: ScaledObject demo-kvtune: HTTP 404: /apis/keda.sh/v1alpha1/namespaces/llm/",
    ),
    "locust stats not JSON": (
        "locust",
        set_field("locust_stats", b"<html>"),
        "FAIL  locust web UI: not JSON",
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_check_fails_on_its_fault_and_says_what_it_saw(fault: str, serve: Any, tmp_path: Path) -> None:
    check, breaks, says = FAULTS[fault]
    docs, release = rendered({"tests": {"rolloutTimeoutSeconds": 1}})
    breaks(release)
    result = run_pod(one_pod(docs, check), serve(release), tmp_path, SECRETS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert says in result.stdout, result.stdout
    assert KEY not in result.stdout + result.stderr
    assert not result.stderr


def test_a_missing_key_in_the_secret_fails_naming_the_secret(serve: Any, tmp_path: Path) -> None:
    docs, release = rendered()
    result = run_pod(one_pod(docs, "api-key"), serve(release), tmp_path, secrets={})
    assert result.returncode == 1
    assert result.stdout == (
        "FAIL  API key: KVTUNE_API_KEY is empty: key api-key of secret/engine-key is missing or empty\n"
    )


def test_an_object_the_role_does_not_grant_is_forbidden(serve: Any, tmp_path: Path) -> None:
    """The fake API enforces the chart's Role: a check reading past it fails here, not only in a cluster."""
    docs, release = rendered()
    release.role_rules = [rule for rule in release.role_rules if rule["resources"] != ["servicemonitors"]]
    result = run_pod(one_pod(docs, "objects"), serve(release), tmp_path, SECRETS)
    assert result.returncode == 1
    assert "FAIL  servicemonitor: ServiceMonitor demo-kvtune: HTTP 403: forbidden" in result.stdout
    assert "PASS  inferencepool: InferencePool demo-kvtune exists" in result.stdout


def test_no_engine_answering_fails_each_http_check_quickly(tmp_path: Path) -> None:
    docs, _release = rendered()
    for check in ("health", "models", "api-key", "completion", "metrics", "locust"):
        result = run_pod(one_pod(docs, check), "http://127.0.0.1:9", tmp_path, SECRETS)
        assert result.returncode == 1, check
        assert "no answer (" in result.stdout and "Traceback" not in result.stderr, result.stdout
