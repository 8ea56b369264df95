"""Schema validation of Kubernetes manifests, without a cluster.

Built-in kinds (Deployment, Service, ConfigMap, HPA autoscaling/v2, ...) are validated with
kubernetes-validate against the schemas of KUBERNETES_VERSION, strictly: an unknown field
is an error, as with `kubectl apply` (strict field validation). Custom resources
(ServiceMonitor, PodMonitor, PrometheusRule, ScaledObject, HTTPRoute, InferencePool, ...)
are validated by tests/k8s_schemas/validate.mjs against their CRD schemas; see that file
for what its validators check.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]

SCHEMAS_DIR = Path(__file__).resolve().parent / "k8s_schemas"
PACKAGE_LOCK = SCHEMAS_DIR / "package-lock.json"
VALIDATE_SCRIPT = SCHEMAS_DIR / "validate.mjs"
# Written by the package's postinstall script, after every dependency is installed.
GENERATED_VALIDATOR = (
    SCHEMAS_DIR
    / "node_modules"
    / ".inferencepool"
    / "_schemas"
    / "InferenceNetworkingK8sIoV1InferencePool.js"
)

# The newest Kubernetes version whose schemas the pinned kubernetes-validate ships.
KUBERNETES_VERSION: str = "1.37.0"

# Built-in API groups with a dot in their name (builtin-groups.json, which validate.mjs reads too);
# a group without a dot ("" for v1, apps, autoscaling, batch, policy, ...) is built in too.
BUILTIN_GROUPS: frozenset[str] = frozenset(
    json.loads((SCHEMAS_DIR / "builtin-groups.json").read_text(encoding="utf-8"))
)

NODE_TIMEOUT_S = 120
NPM_TIMEOUT_S = 600


class K8sValidationSetupError(RuntimeError):
    """The validators could not be installed or run (not a validation failure)."""


def _crd_packages() -> dict[str, str]:
    lock = json.loads(PACKAGE_LOCK.read_text(encoding="utf-8"))
    packages: dict[str, dict[str, Any]] = lock.get("packages", {})
    direct: dict[str, str] = packages.get("", {}).get("dependencies", {})
    return {name: str(packages[f"node_modules/{name}"]["version"]) for name in sorted(direct)}


# Package -> exact version of the npm packages validate.mjs uses, as locked.
CRD_PACKAGES: dict[str, str] = _crd_packages()


def _inputs_newest_mtime() -> float:
    inputs = [PACKAGE_LOCK, SCHEMAS_DIR / "package.json", *sorted((SCHEMAS_DIR / "crds").glob("*.yaml"))]
    return max(p.stat().st_mtime for p in inputs)


def _installed() -> bool:
    return GENERATED_VALIDATOR.is_file() and GENERATED_VALIDATOR.stat().st_mtime >= _inputs_newest_mtime()


def ensure_node_modules() -> Path:
    """Install tests/k8s_schemas/node_modules with `npm ci` when missing or stale.

    Stale means older than package-lock.json, package.json or a CRD under crds/. Safe to
    call from parallel test workers (one installs, the others wait). Returns node_modules.
    """
    node_modules = SCHEMAS_DIR / "node_modules"
    if _installed():
        return node_modules
    npm = shutil.which("npm")
    if npm is None:
        raise K8sValidationSetupError(
            f"npm is not on PATH: it is needed to install the CRD validators in {SCHEMAS_DIR} "
            "(install Node.js and npm, then run `npm ci` there)"
        )
    digest = hashlib.sha256(str(SCHEMAS_DIR).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"kvtune-k8s-schemas-{digest}.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed():
            return node_modules
        try:
            proc = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"],
                cwd=SCHEMAS_DIR,
                capture_output=True,
                text=True,
                timeout=NPM_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise K8sValidationSetupError(f"`npm ci` in {SCHEMAS_DIR} took over {NPM_TIMEOUT_S} s") from exc
        if proc.returncode != 0 or not GENERATED_VALIDATOR.is_file():
            raise K8sValidationSetupError(
                f"`npm ci` in {SCHEMAS_DIR} failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
    return node_modules


def doc_key(doc: Any) -> str:
    """ "Kind/name" of a manifest, with placeholders for what is missing."""
    if not isinstance(doc, dict):
        return f"<not an object: {type(doc).__name__}>"
    kind = doc.get("kind") if isinstance(doc.get("kind"), str) else "<no kind>"
    metadata = doc.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return f"{kind}/{name if isinstance(name, str) and name else '<no name>'}"


def is_custom(doc: dict[str, Any]) -> bool:
    """True when the object's API group is not a built-in Kubernetes group."""
    api_version = doc.get("apiVersion")
    if not isinstance(api_version, str):
        return False
    group = api_version.rpartition("/")[0] if "/" in api_version else ""
    return "." in group and group not in BUILTIN_GROUPS


def _field_path(path: Any) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "(root)"


def _add(report: dict[str, list[str]], key: str, errors: list[str]) -> None:
    if key in report:
        report[key].append(f"{key} appears more than once")
    else:
        report[key] = errors


def validate_core(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Validate the built-in kinds among docs with kubernetes-validate (strict).

    Custom resources are skipped. The value is a list holding the first schema error
    kubernetes-validate finds, or empty when the object is valid.
    """
    report: dict[str, list[str]] = {}
    for doc in docs:
        if not isinstance(doc, dict) or is_custom(doc):
            continue
        key = doc_key(doc)
        if not isinstance(doc.get("apiVersion"), str) or not isinstance(doc.get("kind"), str):
            _add(report, key, ["object has no apiVersion or no kind"])
            continue
        errors: list[str] = []
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{_field_path(exc.path)}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            errors.append(
                f"no schema for {doc['apiVersion']} {doc['kind']} in Kubernetes {KUBERNETES_VERSION}"
            )
        _add(report, key, errors)
    return report


def run_validate_mjs(docs: list[Any]) -> list[dict[str, Any]]:
    """Run validate.mjs on docs and return its report entries."""
    ensure_node_modules()
    node = shutil.which("node")
    if node is None:
        raise K8sValidationSetupError("node is not on PATH: it is needed to validate custom resources")
    try:
        proc = subprocess.run(
            [node, str(VALIDATE_SCRIPT)],
            cwd=SCHEMAS_DIR,
            input=json.dumps(docs),
            capture_output=True,
            text=True,
            timeout=NODE_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise K8sValidationSetupError(f"validate.mjs took over {NODE_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        raise K8sValidationSetupError(f"validate.mjs failed (exit {proc.returncode}): {proc.stderr[-4000:]}")
    try:
        entries = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise K8sValidationSetupError(
            f"validate.mjs printed no JSON report: {proc.stdout[-2000:]!r}"
        ) from exc
    if not isinstance(entries, list):
        raise K8sValidationSetupError(f"validate.mjs report is not a list: {entries!r}")
    return entries


def validate_custom(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Validate the custom resources among docs against their CRD schemas (validate.mjs).

    Built-in kinds are skipped; a custom kind without a known schema is an error.
    """
    custom = [doc for doc in docs if isinstance(doc, dict) and is_custom(doc)]
    if not custom:
        return {}
    report: dict[str, list[str]] = {}
    for entry in run_validate_mjs(custom):
        key = f"{entry.get('kind') or '<no kind>'}/{entry.get('name') or '<no name>'}"
        _add(report, key, [str(e) for e in entry.get("errors", [])])
    return report


def validate_all(docs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Validate every doc, built-in or custom, exactly once.

    A doc that neither validator covered, a doc without metadata.name and two docs with
    the same Kind/name are errors too.
    """
    report = validate_core(docs)
    for key, errors in validate_custom(docs).items():
        _add(report, key, errors)
    seen: set[str] = set()
    for doc in docs:
        key = doc_key(doc)
        if not isinstance(doc, dict):
            report.setdefault(key, []).append("not a Kubernetes object")
            continue
        if key.endswith("/<no name>"):
            report.setdefault(key, []).append("metadata.name: required field is missing")
        if key in seen:
            continue
        seen.add(key)
        if key not in report:
            report[key] = [f"not validated: no validator covers {doc.get('apiVersion')} {doc.get('kind')}"]
    return report


def failures(report: dict[str, list[str]]) -> dict[str, list[str]]:
    """The entries of a report that have errors."""
    return {key: errors for key, errors in report.items() if errors}
