"""The kvtune chart rendered and linted by Helm's own engine (helm-python-sdk: Helm 4's Go SDK, no binary)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "kvtune"
RELEASE = "demo"
# What a user installs into kvtune's image: the embedded models sit here (deploy/Dockerfile).
IMAGE_CACHE_DIR = "/opt/kvtune"
# The pod-spec options clusters require, each set (tests check each lands in the pod and validates).
POD_OPTIONS: dict[str, Any] = {
    "runtimeClassName": "nvidia",
    "priorityClassName": "inference-critical",
    "serviceAccountName": "model-reader",
    "extraVolumes": [{"name": "certs", "secret": {"secretName": "corp-ca"}}],
    "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True}],
    "initContainers": [{"name": "wait", "image": "busybox:1.37", "command": ["true"]}],
    "podDisruptionBudget": {"enabled": True},
    "extraObjects": [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "site-notes"}, "data": {"a": "b"}},
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: '{{ .Release.Name }}-extra'\n",
    ],
}
NAMESPACE = "llm"
# libyaml's loader where PyYAML has it: the release's manifests (the check scripts ride in ConfigMaps) are
# read several times faster than by the pure-Python one.
_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Several values files as `helm install -f A -f B` merges them: later keys win, maps merge."""
    out: dict[str, Any] = {}
    for layer in layers:
        out = _merge(out, layer)
    return out


def at_path(path: str, value: Any) -> dict[str, Any]:
    """Values setting VALUE at a dotted PATH ("autoscaling.keda.threshold": nested mappings)."""
    out: dict[str, Any] = {}
    node = out
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _merge(result[key], value)
        else:
            result[key] = value
    return result


def render(*layers: dict[str, Any], name: str = RELEASE) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` with these values files (schema checked)."""
    with helm.Chart.load(str(CHART)) as chart:
        rendered: dict[str, str] = chart.render(
            merged(*layers), name=name, namespace=NAMESPACE, is_install=True
        )
    return rendered


def manifests(*layers: dict[str, Any], name: str = RELEASE) -> list[dict[str, Any]]:
    """Every Kubernetes object the chart renders with these values (NOTES.txt left out)."""
    docs: list[dict[str, Any]] = []
    for path, text in sorted(render(*layers, name=name).items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.load_all(text, Loader=_LOADER) if doc]
    return docs


def notes(*layers: dict[str, Any]) -> str:
    return next(text for path, text in render(*layers).items() if path.endswith("NOTES.txt"))


def lint(*layers: dict[str, Any]) -> dict[str, Any]:
    report: dict[str, Any] = helm.lint(str(CHART), merged(*layers), strict=True, namespace=NAMESPACE)
    return report


def render_error(*layers: dict[str, Any]) -> str:
    """The message Helm refuses these values with (AssertionError when it renders them)."""
    try:
        render(*layers)
    except helm.HelmError as exc:
        return str(exc)
    raise AssertionError(f"the chart rendered values it should refuse: {merged(*layers)}")


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, rendered {len(found)}"
    return found[0]


def engine_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(docs, "Deployment", f"{RELEASE}-kvtune")
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    assert isinstance(container, dict)
    return container


def load_values(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    return data


def without_address(args: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--host", "--port"):
            skip = True
        else:
            out.append(arg)
    return out


def render_cli(profile: Path) -> tuple[dict[str, str], list[str]]:
    """`kvtune render --format argv` as a user runs it: the environment, then the engine's command."""
    printed = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "render", str(profile), "--format", "argv",
         "--cache-dir", IMAGE_CACHE_DIR],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    words = shlex.split(printed)
    env: dict[str, str] = {}
    if words[0] == "env":
        words = words[1:]
        while "=" in words[0]:
            name, _, value = words.pop(0).partition("=")
            env[name] = value
    return env, words


def scaled_object_query(values: dict[str, Any]) -> tuple[str, str]:
    """The (query, threshold) of the one ScaledObject the chart renders with VALUES (KEDA enabled for it)."""
    layers = merged({"autoscaling": {"keda": {"enabled": True}}}, values)
    (trigger,) = one(manifests(layers), "ScaledObject")["spec"]["triggers"]
    metadata = trigger["metadata"]
    return str(metadata["query"]), str(metadata["threshold"])


def pod_matchers(fullname: str = f"{RELEASE}-kvtune", namespace: str = NAMESPACE) -> str:
    """The label matchers the chart's autoscaler selects an engine's pods by (its Deployment's pods,
    FULLNAME-REPLICASET-POD), as `scaling_query` takes them."""
    return f'namespace="{namespace}",pod=~"{fullname}-[a-z0-9]+-[a-z0-9]+"'
