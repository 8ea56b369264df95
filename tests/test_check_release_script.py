"""deploy/k8s/check-release.sh without a cluster: syntax, shellcheck, its command line, and runs against a
fake helm that answers like `helm test` on a passing release, a failing one and one without test pods.

What the test pods themselves check is tests/test_helm_test_pods.py's."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "k8s" / "check-release.sh"
SHELLCHECK = Path("/usr/bin/shellcheck")
BASH = shutil.which("bash") or "/bin/bash"

# `helm version` and `helm test` as Helm 4 answers them; FAKE_HELM picks the release's state (pass, fail,
# none: no test pods) and FAKE_HELM_VERSION the version. Every call is logged, one line of argv each.
FAKE_HELM = r"""#!/usr/bin/env python3
import os, sys
from pathlib import Path

with open(Path(__file__).parent / "calls.log", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\n")
if sys.argv[1] == "version":
    print(os.environ.get("FAKE_HELM_VERSION", "v4.2.0"))
    sys.exit(0)
state = os.environ.get("FAKE_HELM", "pass")
print("NAME: demo\nSTATUS: deployed\nREVISION: 1")
if state == "none":
    print("TEST SUITE: None")
    sys.exit(0)
print("TEST SUITE:     demo-kvtune-test-rollout\nPhase:          Succeeded")
phase = "Failed" if state == "fail" else "Succeeded"
print("TEST SUITE:     demo-kvtune-test-health\nPhase:          " + phase)
if "--logs" in sys.argv:
    print("\nPOD LOGS: demo-kvtune-test-rollout")
    print("PASS  rollout: deployment/demo-kvtune successfully rolled out (1 available)")
    print("PASS  engine pods: 1/1 engine pods Ready\n")
    print("POD LOGS: demo-kvtune-test-health")
    if state == "fail":
        print("FAIL  GET /health: HTTP 503: not ready\n")
    else:
        print("PASS  GET /health: HTTP 200\n")
if state == "fail":
    print("Error: pod demo-kvtune-test-health failed", file=sys.stderr)
    sys.exit(1)
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def helm(tmp_path: Path) -> Path:
    program = tmp_path / "helm"
    program.write_text(FAKE_HELM)
    program.chmod(0o755)
    return program


def calls(helm: Path) -> list[str]:
    return (helm.parent / "calls.log").read_text().splitlines()


def test_bash_parses_it() -> None:
    result = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_shellcheck_finds_nothing() -> None:
    assert SHELLCHECK.exists(), (
        "shellcheck is not installed: install Debian's package (apt-get install -y shellcheck)"
    )
    result = subprocess.run([str(SHELLCHECK), str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_it_is_a_thin_wrapper() -> None:
    """The checks are the chart's test pods: the script starts no port-forward and sends no request."""
    code = [line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert len(code) < 120
    for word in ("port-forward", "curl", "kubectl get"):
        assert not [line for line in code if word in line], word


def test_help_prints_usage() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: check-release.sh RELEASE [NAMESPACE]")
    for name in ("HELM", "TIMEOUT", "helm test"):
        assert name in result.stdout


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ((), {}, "RELEASE is required"),
        (("demo", "ns1", "extra"), {}, "too many arguments"),
        (("--kubeconfig", "demo"), {}, "unknown option --kubeconfig"),
        (("demo",), {"TIMEOUT": "40 m"}, "TIMEOUT is a duration"),
    ],
)
def test_a_bad_command_line_is_a_usage_error(
    args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = run(*args, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert "usage: check-release.sh RELEASE [NAMESPACE]" in result.stderr
    assert result.stdout == ""


def test_without_helm_it_says_so(tmp_path: Path) -> None:
    result = run("demo", env={"HELM": str(tmp_path / "no-helm")})
    assert result.returncode == 2
    assert "helm not found" in result.stderr and "set HELM" in result.stderr


def test_a_passing_release_passes_with_every_pod_s_log(helm: Path) -> None:
    result = run("demo", "ns1", env={"HELM": str(helm)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls(helm)[-1] == "test demo --namespace ns1 --timeout 40m --logs"
    assert "PASS  GET /health: HTTP 200" in result.stdout
    assert result.stdout.rstrip().endswith("3 passed, 0 failed")


def test_a_failing_release_fails_saying_where_it_stopped(helm: Path) -> None:
    result = run("demo", env={"HELM": str(helm), "FAKE_HELM": "fail", "TIMEOUT": "2400"})
    assert result.returncode == 1, result.stdout + result.stderr
    # No namespace given: helm's own (the kubectl context's); a bare number of seconds gets its unit.
    assert calls(helm)[-1] == "test demo --timeout 2400s --logs"
    assert "FAIL  GET /health: HTTP 503: not ready" in result.stdout
    assert "Error: pod demo-kvtune-test-health failed" in result.stdout
    assert "2 passed, 1 failed" in result.stdout
    assert "helm test failed (exit 1)" in result.stderr


def test_a_release_without_test_pods_fails(helm: Path) -> None:
    result = run("demo", env={"HELM": str(helm), "FAKE_HELM": "none"})
    assert result.returncode == 1
    assert "has no test pods" in result.stderr and "tests.enabled=true" in result.stderr


def test_helm_3_runs_the_tests_without_logs(helm: Path) -> None:
    """Helm 3 deletes a passed pod (hook-succeeded) before --logs would read it, and then fails."""
    result = run("demo", env={"HELM": str(helm), "FAKE_HELM_VERSION": "v3.17.0"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls(helm)[-1] == "test demo --timeout 40m"
