"""deploy/k8s/check-release.sh without a cluster: syntax, shellcheck, its command line, and runs against
fake kubectl and helm programs (one failing every call, one answering like a healthy release)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "k8s" / "check-release.sh"
CHART = ROOT / "helm" / "kvtune"
SHELLCHECK = Path("/usr/bin/shellcheck")
BASH = shutil.which("bash") or "/bin/bash"


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BASH, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def lines(output: str, status: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(f"{status}  ")]


def write_program(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_bash_parses_it() -> None:
    result = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_shellcheck_finds_nothing() -> None:
    assert SHELLCHECK.exists(), (
        "shellcheck is not installed: install Debian's package (apt-get install -y shellcheck)"
    )
    result = subprocess.run([str(SHELLCHECK), str(SCRIPT)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_help_prints_usage() -> None:
    result = run("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: check-release.sh RELEASE [NAMESPACE]")
    for name in ("KUBECTL", "TIMEOUT"):
        assert name in result.stdout


def test_no_arguments_is_a_usage_error() -> None:
    result = run()
    assert result.returncode == 2
    assert "RELEASE is required" in result.stderr
    assert "usage: check-release.sh RELEASE [NAMESPACE]" in result.stderr
    assert result.stdout == ""


def test_names_match_the_chart() -> None:
    """The dashboard stems, alert and metric names the script checks are the chart's."""
    text = SCRIPT.read_text()
    stems = re.search(r'^DASHBOARD_STEMS="([^"]*)"', text, re.M)
    assert stems is not None
    assert sorted(stems.group(1).split()) == sorted(
        p.stem for p in (CHART / "files/dashboards").glob("*.json")
    )
    alerts = (CHART / "files" / "kvtune-alerts.yaml").read_text()
    assert "- name: kvtune\n" in alerts
    assert "- alert: KvtuneTtftP99AboveSlo\n" in alerts
    metrics = re.search(r'^REQUIRED_METRICS="([^"]*)"', text, re.M)
    assert metrics is not None
    queried = alerts + "".join(p.read_text() for p in (CHART / "files/dashboards").glob("*.json"))
    for metric in metrics.group(1).split():
        assert metric in queried, metric


FAILING_KUBECTL = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/calls.log"
echo "error: fake kubectl: no cluster here" >&2
exit 1
"""


def test_a_failing_kubectl_fails_the_rollout_check_quickly(tmp_path: Path) -> None:
    kubectl = write_program(tmp_path / "kubectl", FAILING_KUBECTL)
    started = time.monotonic()
    result = run("demo", "ns1", env={"KUBECTL": str(kubectl), "HELM": str(tmp_path / "no-helm")})
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stdout + result.stderr
    rollout = [line for line in lines(result.stdout, "FAIL") if line.startswith("FAIL  rollout:")]
    assert len(rollout) == 1, result.stdout
    assert "deployment/demo-kvtune" in rollout[0]
    assert "no cluster here" in rollout[0]
    # The engine's HTTP checks are skipped, not attempted through a port-forward that cannot start.
    calls = (tmp_path / "calls.log").read_text()
    assert "port-forward" not in calls
    assert "-n ns1 rollout status deployment/demo-kvtune --timeout=1800s" in calls
    assert elapsed < 30, elapsed


# A fake cluster holding a healthy release "demo" (objects named demo-kvtune) with every feature on.
# `port-forward` serves the engine's or Locust's HTTP API itself on the local port; BROKEN=1 breaks a few
# things the script must notice.
FAKE_KUBECTL = r"""#!/usr/bin/env python3
import base64, http.server, json, os, sys
from pathlib import Path

HERE = Path(__file__).parent
BROKEN = os.environ.get("BROKEN") == "1"
args = sys.argv[1:]
with open(HERE / "calls.log", "a") as log:
    log.write(" ".join(args) + "\n")
while args and (args[0] == "-n" or args[0].startswith("--request-timeout")):
    args = args[2:] if args[0] == "-n" else args[1:]

def out(value):
    sys.stdout.write(value if isinstance(value, str) else json.dumps(value))
    sys.exit(0)

def missing(kind, name):
    sys.stderr.write(f'Error from server (NotFound): {kind} "{name}" not found\n')
    sys.exit(1)

ENGINE = {"spec": {"template": {"spec": {"containers": [{
    "name": "vllm",
    "args": ["--model", "/models/tiny", "--served-model-name", "tiny-chat", "--port", "8000"],
    "env": [{"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "demo-key", "key": "api.key"}}}],
}]}}}}
POD = {"metadata": {"name": "demo-kvtune-abc"}, "status": {"phase": "Running",
       "conditions": [{"type": "Ready", "status": "True"}]}}
RULE = {"spec": {"groups": [{"name": "kvtune", "rules": [{"alert": "KvtuneTtftP99AboveSlo", "expr": "1"}]}]}}
ROUTE = {"status": {"parents": [{"parentRef": {"name": "gw"}, "conditions": [
    {"type": "Accepted", "status": "False" if BROKEN else "True", "reason": "Accepted"}]}]}}
METRICS = "\n".join([
    "# HELP vllm:kv_cache_usage_perc KV-cache usage.",
    'vllm:prefix_cache_queries_total{model_name="tiny-chat"} 12.0',
    'vllm:num_preemptions_total{model_name="tiny-chat"} 0.0',
    'vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny-chat"} 1.0',
] + ([] if BROKEN else ['vllm:kv_cache_usage_perc{model_name="tiny-chat"} 0.1'])) + "\n"

class Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *_):
        pass

    def send(self, code, body, kind="application/json"):
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorized(self):
        return BROKEN or self.headers.get("Authorization") == "Bearer s3cret"

    def do_GET(self):
        if self.server.locust:
            if self.path == "/":
                return self.send(200, "<html>locust</html>", "text/html")
            if self.path == "/stats/requests":
                stats = {"state": "ready", "user_count": 0, "worker_count": 2}
                return self.send(200, "oops" if BROKEN else stats)
        elif self.path == "/health":
            return self.send(200, "")
        elif self.path == "/metrics":
            return self.send(200, METRICS, "text/plain")
        elif self.path == "/v1/models":
            if not self.authorized():
                return self.send(401, {"error": "Unauthorized"})
            return self.send(200, {"data": [{"id": "tiny-chat"}]})
        self.send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or not self.authorized():
            return self.send(401, {"error": "Unauthorized"})
        assert body == {"model": "tiny-chat", "prompt": "The capital of France is", "max_tokens": 8}, body
        self.send(200, {"choices": [{"index": 0, "text": " Paris."}]})

def port_forward(target, ports):
    local, remote = ports.split(":")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(local)), Handler)
    server.locust = target.endswith("-locust")
    (HERE / f"port-forward-{local}.pid").write_text(str(os.getpid()))
    print(f"Forwarding from 127.0.0.1:{local} -> {remote}", flush=True)
    server.serve_forever()

verb = args[0]
if verb == "config":
    out("")
if verb == "rollout":
    out(f'deployment "{args[2].split("/")[1]}" successfully rolled out\n')
if verb == "port-forward":
    port_forward(args[3], args[4])
kind, name = args[1], args[2]
objects = {
    ("deployment", "demo-kvtune"): ENGINE,
    ("deployment", "demo-kvtune-locust-master"): {},
    ("deployment", "demo-kvtune-locust-worker"): "2",
    ("pods", "-l"): {"items": [POD]},
    ("service", "demo-kvtune"): "8000",
    ("service", "demo-kvtune-locust"): "8089",
    ("secret", "demo-key"): base64.b64encode(b"s3cret").decode(),
    ("servicemonitors.monitoring.coreos.com", "demo-kvtune"): {},
    ("podmonitors.monitoring.coreos.com", "demo-kvtune"): {},
    ("prometheusrules.monitoring.coreos.com", "demo-kvtune"): RULE,
    ("configmap", "-l"): "\n".join(f"demo-kvtune-{s}" for s in ("kvtune-kv-cache", "kvtune-latency-load",
                                                                "kvtune-sweep")),
    ("configmap", "demo-kvtune-kvtune-kv-cache"): {},
    ("horizontalpodautoscalers.autoscaling", "demo-kvtune"): "1|1|True|ValidMetricFound|ok",
    ("scaledobjects.keda.sh", "demo-kvtune"): "True|False|keda-hpa-demo-kvtune|ScaledObject is defined",
    ("inferencepools.inference.networking.k8s.io", "demo-kvtune"): {},
    ("httproutes.gateway.networking.k8s.io", "demo-kvtune"): ROUTE,
}
if (kind, name) not in objects:
    missing(kind, name)
if kind == "secret":
    assert args[4] == "jsonpath={.data.api\\.key}", args
out(objects[(kind, name)])
"""

FAKE_HELM = """#!/usr/bin/env python3
import json, sys
assert sys.argv[1:] == ["get", "values", "demo", "-n", "ns1", "-a", "-o", "json"], sys.argv
on = {"enabled": True}
print(json.dumps({
    "monitoring": {"serviceMonitor": on, "podMonitor": on, "prometheusRule": on,
                   "dashboards": {"enabled": True, "labels": {"grafana_dashboard": "1"}}},
    "autoscaling": {"hpa": on, "keda": on},
    "inferencePool": {"enabled": True, "httpRoute": on},
    "locust": {"enabled": True, "workers": 2},
}))
"""


def fake_cluster(tmp_path: Path, *, broken: bool) -> dict[str, str]:
    kubectl = write_program(
        tmp_path / "kubectl", FAKE_KUBECTL.replace("/usr/bin/env python3", sys.executable)
    )
    helm = write_program(tmp_path / "helm", FAKE_HELM.replace("/usr/bin/env python3", sys.executable))
    return {"KUBECTL": str(kubectl), "HELM": str(helm), "TIMEOUT": "90", "BROKEN": "1" if broken else "0"}


def assert_port_forwards_stopped(tmp_path: Path) -> None:
    pids = [int(p.read_text()) for p in tmp_path.glob("port-forward-*.pid")]
    assert len(pids) == 2, pids  # the engine's and Locust's
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize("with_helm", [True, False], ids=["helm-values", "objects-detected"])
def test_a_healthy_release_passes_every_check(tmp_path: Path, with_helm: bool) -> None:
    env = fake_cluster(tmp_path, broken=False)
    if not with_helm:
        env["HELM"] = str(tmp_path / "no-helm")
    result = run("demo", "ns1", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert lines(result.stdout, "FAIL") == []
    features = "servicemonitor podmonitor prometheusrule dashboards hpa keda inferencepool httproute locust"
    values = [line for line in result.stdout.splitlines() if line.endswith(f"on: {features}")]
    assert len(values) == 1, result.stdout
    assert values[0].startswith("PASS  helm values:" if with_helm else "SKIP  helm values:")
    assert len(lines(result.stdout, "SKIP")) == (0 if with_helm else 1)
    passed = {line.split(":")[0].removeprefix("PASS  ") for line in lines(result.stdout, "PASS")}
    assert passed | {"helm values"} == {
        "helm values",
        "rollout",
        "engine pods",
        "engine port-forward",
        "GET /health",
        "GET /v1/models",
        "API key",
        "POST /v1/completions",
        "GET /metrics",
        "servicemonitor",
        "podmonitor",
        "prometheusrule",
        "dashboards",
        "hpa",
        "keda",
        "inferencepool",
        "httproute",
        "locust master",
        "locust workers",
        "locust web UI",
        "locust stats",
    }, result.stdout
    assert "--timeout=90s" in (tmp_path / "calls.log").read_text()
    assert "s3cret" not in result.stdout + (tmp_path / "calls.log").read_text()
    assert_port_forwards_stopped(tmp_path)


def test_a_broken_release_fails_what_is_broken(tmp_path: Path) -> None:
    result = run("demo", "ns1", env=fake_cluster(tmp_path, broken=True))
    assert result.returncode == 1, result.stdout + result.stderr
    failed = {line.split(":")[0].removeprefix("FAIL  "): line for line in lines(result.stdout, "FAIL")}
    assert set(failed) == {"API key", "GET /metrics", "httproute", "locust stats"}, result.stdout
    assert "without the key: HTTP 200" in failed["API key"]
    assert "missing: vllm:kv_cache_usage_perc" in failed["GET /metrics"]
    assert "Accepted=False" in failed["httproute"]
    assert "not JSON" in failed["locust stats"]
    assert_port_forwards_stopped(tmp_path)


def sigint_as_at_a_terminal() -> None:
    """SIGINT at its default in the script, as in a terminal, even when this suite runs with it ignored
    (started in the background by a non-interactive shell): bash cannot trap a signal ignored at entry."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupted_it_stops_its_port_forward(tmp_path: Path) -> None:
    """A stalled request (the completion never answers) and Ctrl-C: the port-forward goes with the script."""
    env = fake_cluster(tmp_path, broken=False)
    stalled = tmp_path / "stalled"  # the fake says when the request is stuck in it
    stall = FAKE_KUBECTL.replace(
        "def do_POST(self):", 'def do_POST(self):\n        (HERE / "stalled").touch()\n        time.sleep(60)'
    )
    stall = stall.replace("import base64,", "import time, base64,")
    write_program(Path(env["KUBECTL"]), stall.replace("/usr/bin/env python3", sys.executable))
    process = subprocess.Popen(
        [BASH, str(SCRIPT), "demo", "ns1"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        start_new_session=True,
        preexec_fn=sigint_as_at_a_terminal,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("PASS  API key"):
            break
    # Ctrl-C once the script is blocked in the stalled request, the case this test is about.
    deadline = time.monotonic() + 30
    while not stalled.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stalled.exists(), "the completion request never reached the fake engine"
    time.sleep(0.2)  # curl is waiting on the answer
    os.killpg(process.pid, signal.SIGINT)
    assert process.wait(timeout=30) == 130
    pids = [int(p.read_text()) for p in tmp_path.glob("port-forward-*.pid")]
    assert len(pids) == 1, pids
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pids[0], 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"port-forward {pids[0]} still running after the script was interrupted")
