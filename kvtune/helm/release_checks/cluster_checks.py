"""The release's checks through the Kubernetes API, run by `helm test` in the chart's test pods: the
Deployments roll out and every engine pod is Ready; each optional object the release turned on is there and
working (ServiceMonitor or PodMonitor, the PrometheusRule's alerts, the dashboard ConfigMaps, the HPA or KEDA
ScaledObject, the InferencePool and the HTTPRoute's acceptance by its Gateway).

Standard library only: a pod runs this as `python3 -c SCRIPT CHECK [ARGS]` in an image without kvtune, with a
ServiceAccount the chart's test Role lets read these objects and nothing else. One PASS or FAIL line per
object; exit 1 when one failed, 2 on a usage error.

Environment: NAMESPACE; for `rollout`, ROLLOUT_TIMEOUT_SECONDS and ENGINE_POD_SELECTOR; for `objects`,
RELEASE_OBJECTS (JSON, written by the chart). Outside a pod (tests), KUBERNETES_API and SERVICE_ACCOUNT_DIR
say where the API server and the token are.
"""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
REQUEST_TIMEOUT_S = 30.0
POLL_S = 5.0
DEFAULT_ROLLOUT_TIMEOUT_S = 1800.0
MAX_BODY_BYTES = 16 << 20

# Each check of RELEASE_OBJECTS -> (kind, API group/version, resource), in the order the checks run.
OBJECT_KINDS: dict[str, tuple[str, str, str]] = {
    "serviceMonitor": ("ServiceMonitor", "apis/monitoring.coreos.com/v1", "servicemonitors"),
    "podMonitor": ("PodMonitor", "apis/monitoring.coreos.com/v1", "podmonitors"),
    "prometheusRule": ("PrometheusRule", "apis/monitoring.coreos.com/v1", "prometheusrules"),
    "dashboards": ("ConfigMap", "api/v1", "configmaps"),
    "hpa": ("HorizontalPodAutoscaler", "apis/autoscaling/v2", "horizontalpodautoscalers"),
    "keda": ("ScaledObject", "apis/keda.sh/v1alpha1", "scaledobjects"),
    "inferencePool": ("InferencePool", "apis/inference.networking.k8s.io/v1", "inferencepools"),
    "httpRoute": ("HTTPRoute", "apis/gateway.networking.k8s.io/v1", "httproutes"),
}


def object_path(check: str, namespace: str, name: str) -> str:
    _kind, api, resource = OBJECT_KINDS[check]
    return f"/{api}/namespaces/{namespace}/{resource}/{name}"


class Result(NamedTuple):
    title: str
    passed: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.passed else 'FAIL'}  {self.title}: {' '.join(self.detail.split())}"


class ApiError(Exception):
    """The API server answered with an error (not found, forbidden, ...): waiting will not change it."""


class Unreachable(Exception):
    """No answer from the API server: a rollout wait tries again."""


class KubeApi:
    """GETs on the Kubernetes API with the pod's ServiceAccount token (read on each request: kubelet
    rotates it)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.account = Path(environ.get("SERVICE_ACCOUNT_DIR") or SERVICE_ACCOUNT_DIR)
        base = environ.get("KUBERNETES_API", "")
        if not base:
            host = environ.get("KUBERNETES_SERVICE_HOST", "")
            if not host:
                raise ApiError("KUBERNETES_SERVICE_HOST is not set: not in a pod")
            host = f"[{host}]" if ":" in host else host
            base = f"https://{host}:{environ.get('KUBERNETES_SERVICE_PORT', '443')}"
        self.base = base.rstrip("/")
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        ca = self.account / "ca.crt"
        if self.base.startswith("https:") and ca.is_file():
            handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=str(ca))))
        self._opener = urllib.request.build_opener(*handlers)

    def get(self, path: str) -> Any:
        token_file = self.account / "token"
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise ApiError(f"no ServiceAccount token at {token_file} ({error.strerror})") from error
        request = urllib.request.Request(  # noqa: S310 (the API server's URL)
            self.base + path, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"}
        )
        try:
            with self._opener.open(request, timeout=REQUEST_TIMEOUT_S) as response:
                return json.loads(response.read(MAX_BODY_BYTES))
        except urllib.error.HTTPError as error:
            with error:
                raise ApiError(_status_message(error.code, error.read(MAX_BODY_BYTES))) from error
        except (urllib.error.URLError, OSError) as error:
            raise Unreachable(
                f"API server {self.base}: no answer ({getattr(error, 'reason', error)})"
            ) from error
        except ValueError as error:
            raise ApiError(f"GET {path}: not JSON ({error})") from error


def _status_message(code: int, body: bytes) -> str:
    """The message of a Kubernetes Status answer, else the start of the body."""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {code}: {message or body[:200].decode('utf-8', 'replace')}"


def _conditions(obj: Any) -> dict[str, dict[str, Any]]:
    """An object's status conditions by type."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return {str(c.get("type")): c for c in conditions if isinstance(c, dict)}


# ---- rollout ---------------------------------------------------------------------------------------------


def rollout_state(deployment: Any) -> tuple[bool, str]:
    """(rolled out, what it waits for), as `kubectl rollout status` judges a Deployment."""
    spec, status = deployment.get("spec") or {}, deployment.get("status") or {}
    generation = deployment.get("metadata", {}).get("generation", 0)
    if generation > status.get("observedGeneration", 0):
        return False, "waiting for the Deployment spec update to be observed"
    progressing = _conditions(deployment).get("Progressing", {})
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        raise ApiError(f"exceeded its progress deadline: {progressing.get('message', '')}")
    wanted = spec.get("replicas", 1)
    updated = status.get("updatedReplicas", 0)
    if updated < wanted:
        return False, f"{updated} of {wanted} new replicas updated"
    if status.get("replicas", 0) > updated:
        return False, f"{status.get('replicas', 0) - updated} old replicas pending termination"
    available = status.get("availableReplicas", 0)
    if available < updated:
        return False, f"{available} of {updated} updated replicas available"
    return True, f"successfully rolled out ({available} available)"


def wait_for_rollout(api: KubeApi, namespace: str, name: str, deadline: float, timeout_s: float) -> Result:
    title = "rollout"
    path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{name}"
    while True:
        try:
            done, waiting_for = rollout_state(api.get(path))
        except ApiError as error:
            return Result(title, False, f"deployment/{name}: {error}")
        except Unreachable as error:
            done, waiting_for = False, str(error)
        if done:
            return Result(title, True, f"deployment/{name} {waiting_for}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return Result(
                title, False, f"deployment/{name} not rolled out after {timeout_s:g}s: {waiting_for}"
            )
        time.sleep(min(POLL_S, remaining))


def engine_pods_ready(api: KubeApi, namespace: str, selector: str) -> Result:
    title = "engine pods"
    query = urllib.parse.urlencode({"labelSelector": selector})
    try:
        listing = api.get(f"/api/v1/namespaces/{namespace}/pods?{query}")
    except (ApiError, Unreachable) as error:
        return Result(title, False, f"pods -l {selector}: {error}")
    pods = [p for p in listing.get("items") or [] if not p.get("metadata", {}).get("deletionTimestamp")]
    if not pods:
        return Result(title, False, f"no pods match {selector}")
    waiting = [
        f"{pod['metadata'].get('name')} ({(pod.get('status') or {}).get('phase', '?')})"
        for pod in pods
        if _conditions(pod).get("Ready", {}).get("status") != "True"
    ]
    summary = f"{len(pods) - len(waiting)}/{len(pods)} engine pods Ready"
    return Result(title, not waiting, summary + (f": not Ready {', '.join(waiting)}" if waiting else ""))


def check_rollout(api: KubeApi, environ: Mapping[str, str], deployments: Sequence[str]) -> list[Result]:
    """Each Deployment named (the engine's first) rolls out within the timeout; the engine pods are Ready."""
    if not deployments:
        raise ApiError("name the Deployments to wait for, the engine's first")
    namespace = environ.get("NAMESPACE", "")
    timeout_s = float(environ.get("ROLLOUT_TIMEOUT_SECONDS") or DEFAULT_ROLLOUT_TIMEOUT_S)
    deadline = time.monotonic() + timeout_s
    results = [wait_for_rollout(api, namespace, name, deadline, timeout_s) for name in deployments]
    # Even after a failed rollout: the pods' phases say why.
    results.append(engine_pods_ready(api, namespace, environ.get("ENGINE_POD_SELECTOR", "")))
    return results


# ---- optional objects ------------------------------------------------------------------------------------


def _exists(obj: Any, kind: str, name: str, _spec: Any) -> tuple[bool, str]:
    return True, f"{kind} {name} exists"


def _rule_has_alerts(rule: Any, kind: str, name: str, spec: Any) -> tuple[bool, str]:
    """Every alert of kvtune's rules (spec["alerts"]: group -> alert names) is in the live rule."""
    wanted: Mapping[str, Sequence[str]] = spec.get("alerts") or {}
    groups = {g.get("name"): g for g in (rule.get("spec") or {}).get("groups") or [] if isinstance(g, dict)}
    problems, counted = [], 0
    for group_name, alerts in wanted.items():
        group = groups.get(group_name)
        if group is None:
            problems.append(f"no group {group_name} (groups: {', '.join(map(str, groups)) or 'none'})")
            continue
        present = {r.get("alert") for r in group.get("rules") or [] if isinstance(r, dict)}
        missing = [alert for alert in alerts if alert not in present]
        counted += len(alerts) - len(missing)
        if missing:
            problems.append(f"group {group_name} lacks {', '.join(missing)}")
    if problems:
        return False, f"{kind} {name}: {'; '.join(problems)}"
    return True, f"{kind} {name}: all {counted} alerts of kvtune's rules"


def _hpa_active(hpa: Any, kind: str, name: str, _spec: Any) -> tuple[bool, str]:
    status = hpa.get("status") or {}
    active = _conditions(hpa).get("ScalingActive", {})
    replicas = f"replicas {status.get('currentReplicas', '?')}, desired {status.get('desiredReplicas', '?')}"
    # ScalingActive is False while the HPA cannot read its metric (no custom-metrics adapter serving it).
    if active.get("status") == "True":
        return True, f"{kind} {name}: {replicas}, ScalingActive ({active.get('reason', '')})"
    state = f"{active.get('status', 'unset')} {active.get('reason', '')} {active.get('message', '')}"
    return False, f"{kind} {name}: {replicas}, ScalingActive={state}"


def _scaled_object_ready(obj: Any, kind: str, name: str, _spec: Any) -> tuple[bool, str]:
    conditions = _conditions(obj)
    ready, active = conditions.get("Ready", {}), conditions.get("Active", {})
    if ready.get("status") == "True":
        hpa = (obj.get("status") or {}).get("hpaName") or "none yet"
        return True, f"{kind} {name}: Ready, Active={active.get('status', 'unset')}, HPA {hpa}"
    return False, f"{kind} {name}: Ready={ready.get('status', 'unset')} {ready.get('message', '')}"


def _route_accepted(route: Any, kind: str, name: str, _spec: Any) -> tuple[bool, str]:
    parents = (route.get("status") or {}).get("parents") or []
    if not parents:
        return False, (
            f"{kind} {name}: no status from any Gateway yet (is a Gateway controller running, and the "
            "Gateway named right?)"
        )
    seen, accepted_by_all = [], True
    for parent in parents:
        accepted: dict[str, Any] = _conditions({"status": parent}).get("Accepted", {})
        accepted_by_all = accepted_by_all and accepted.get("status") == "True"
        gateway = (parent.get("parentRef") or {}).get("name")
        seen.append(f"{gateway}: Accepted={accepted.get('status', 'unset')} {accepted.get('reason', '')}")
    return accepted_by_all, f"{kind} {name}: {'; '.join(seen)}"


def _dashboards(api: KubeApi, namespace: str, spec: Mapping[str, Any]) -> Result:
    """Every dashboard ConfigMap is there with the labels Grafana's sidecar selects on."""
    labels: Mapping[str, str] = spec.get("labels") or {}
    found, problems = [], []
    for name in spec.get("names") or []:
        try:
            config_map = api.get(object_path("dashboards", namespace, name))
        except (ApiError, Unreachable) as error:
            problems.append(f"{name}: {error}")
            continue
        has = config_map.get("metadata", {}).get("labels") or {}
        wrong = [f"{key}={value}" for key, value in labels.items() if has.get(key) != value]
        if wrong:
            problems.append(f"{name} not labelled {','.join(wrong)}")
        else:
            found.append(name)
    selector = ",".join(f"{key}={value}" for key, value in labels.items())
    if problems or not found:
        return Result("dashboards", False, "; ".join(problems) or "no dashboard ConfigMaps named")
    return Result("dashboards", True, f"ConfigMaps labelled {selector}: {' '.join(found)}")


Judge = Callable[[Any, str, str, Any], tuple[bool, str]]
# How a live object is judged, beyond being there.
JUDGES: dict[str, Judge] = {
    "prometheusRule": _rule_has_alerts,
    "hpa": _hpa_active,
    "keda": _scaled_object_ready,
    "httpRoute": _route_accepted,
}


def check_objects(api: KubeApi, environ: Mapping[str, str], _args: Sequence[str]) -> list[Result]:
    """Each object in RELEASE_OBJECTS, in a fixed order."""
    namespace = environ.get("NAMESPACE", "")
    try:
        objects = json.loads(environ.get("RELEASE_OBJECTS") or "{}")
    except ValueError as error:
        raise ApiError(f"RELEASE_OBJECTS is not JSON ({error})") from error
    results = []
    for check, (kind, _api, _resource) in OBJECT_KINDS.items():
        spec = objects.get(check)
        if not spec:
            continue
        if check == "dashboards":
            results.append(_dashboards(api, namespace, spec))
            continue
        name = spec["name"] if isinstance(spec, dict) else str(spec)
        judge = JUDGES.get(check, _exists)
        try:
            passed, detail = judge(api.get(object_path(check, namespace, name)), kind, name, spec)
        except (ApiError, Unreachable) as error:
            passed, detail = False, f"{kind} {name}: {error}"
        results.append(Result(check.lower(), passed, detail))
    if not results:
        raise ApiError("RELEASE_OBJECTS names no object")
    return results


CHECKS: dict[str, Callable[[KubeApi, Mapping[str, str], Sequence[str]], list[Result]]] = {
    "rollout": check_rollout,
    "objects": check_objects,
}


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    if not argv or argv[0] not in CHECKS:
        sys.stderr.write(f"usage: cluster_checks.py {{{','.join(CHECKS)}}} [ARGS]\n")
        return 2
    try:
        results = CHECKS[argv[0]](KubeApi(environ), environ, argv[1:])
    except (ApiError, Unreachable) as error:
        results = [Result(argv[0], False, str(error))]
    for result in results:
        sys.stdout.write(result.line() + "\n")
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], os.environ))
