"""The kvtune chart, rendered and linted by Helm's real engine, every manifest validated against the schemas
of Kubernetes 1.37 and of the custom resources' CRDs; the engine it deploys is the profile `kvtune render`
describes, and bad values are refused naming the value.

No cluster is needed: deploy/k8s/check-release.sh checks a live release (see the README).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from kvtune import vllm_parser
from kvtune.helm.values import (
    CHART_ENGINE_FIELDS,
    CHART_OMITTED_FIELDS,
    Locust,
    chart_values,
    profile_from_engine,
    values_schema,
)
from kvtune.model_store import EMBEDDED_MODELS
from kvtune.observability.alerts import render_rules
from kvtune.profile import API_SERVER_MODULE, EngineProfile, load_profile, refused_settings
from kvtune.sweep import run_dir
from kvtune.sweep.spec import load_spec
from kvtune.sweep.sweeper import run_sweep
from tests import k8s_validation
from tests.builders import Quiet
from tests.helm_chart import (
    CHART,
    IMAGE_CACHE_DIR,
    POD_OPTIONS,
    RELEASE,
    ROOT,
    engine_container,
    lint,
    load_values,
    manifests,
    notes,
    one,
    render_cli,
    render_error,
    without_address,
)
from tests.helpers_sweep import OUTPUTS_SPEC, measured
from tools import generate

PROFILES = sorted((ROOT / "deploy" / "profiles").glob("*.yaml"))
CPU_SMOKE = load_values(CHART / "values-cpu-smoke.yaml")

EVERYTHING_ON: dict[str, Any] = {
    "engine": {
        "apiKeySecret": {"name": "engine-key", "key": "api-key"},
        "secretEnv": ["EXTRA_TOKEN"],
        "secretEnvSecret": "engine-env",
        "revision": "a09a35458c702b33eeacc393d103063234e8bc28",
        "warmup": [{"role": "system", "text": "You are a helpful assistant. " * 40}],
    },
    "modelSource": {"hubTokenSecret": {"name": "hf", "key": "HF_TOKEN"}},
    # Several pods share the cache: a ReadWriteOnce volume would attach to one node only (refused).
    "cache": {"enabled": True, "storageClassName": "fast", "accessModes": ["ReadWriteMany"]},
    "kvEvents": {"enabled": True},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "prometheusRule": {"enabled": True, "ttftP99SloSeconds": 1.5},
        "dashboards": {"enabled": True, "annotations": {"grafana_folder": "kvtune"}},
    },
    "autoscaling": {"keda": {"enabled": True, "maxReplicas": 6}},
    "inferencePool": {
        "enabled": True,
        "endpointPicker": {"serviceName": "kvtune-epp"},
        "httpRoute": {"enabled": True, "gatewayName": "inference-gateway"},
    },
    "locust": {"enabled": True, "workers": 2, "extraArgs": ["--system-tokens", "800"]},
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    **POD_OPTIONS,
}
# The alternatives of the features above, each only one at a time.
ALTERNATIVES_ON: dict[str, Any] = {
    "modelSource": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "qwen2.5-7b"}},
    "monitoring": {"podMonitor": {"enabled": True}},
    # A signal other than the default, at a share per pod (tests/test_helm_autoscaling.py has each signal).
    "autoscaling": {"signal": "kv_usage", "window": "30s", "hpa": {"enabled": True, "target": 0.8}},
    "locust": {"enabled": True, "workers": 0},
}


@pytest.fixture(scope="module")
def sweep_values(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The values.yaml a sweep writes (the sweep loop with scripted trials: what it writes is real)."""
    tmp = tmp_path_factory.mktemp("sweep")
    spec_path = tmp / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(OUTPUTS_SPEC | {"slo": {"ttft_p99_s": 1.5}}))
    spec = load_spec(spec_path)
    run = run_dir.create(tmp / "runs", spec, spec_path)
    run_sweep(spec, run, model_path=None, progress=Quiet(), trial_runner=lambda _s, p, **_: measured(p))
    return {"values": load_values(run / "values.yaml"), "best": run / "best.yaml"}


def values_sets(sweep_values: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    return {
        "defaults": [],
        "cpu-smoke": [CPU_SMOKE],
        "sweep": [sweep_values["values"]],
        "everything-on": [EVERYTHING_ON],
        "alternatives-on": [ALTERNATIVES_ON],
        "cpu-smoke-everything-on": [CPU_SMOKE, EVERYTHING_ON],
    }


# ---- generated files and one source of truth ------------------------------------------------------------


def test_the_chart_s_generated_files_are_current() -> None:
    stale = [path for path in generate.stale_files() if path.is_relative_to(CHART)]
    assert not stale, f"run `make generate`: stale {stale}"
    committed = json.loads((CHART / "values.schema.json").read_text())
    assert committed == values_schema()


def test_every_profile_field_is_a_chart_value_or_says_why_not() -> None:
    carried, omitted = set(CHART_ENGINE_FIELDS), set(CHART_OMITTED_FIELDS)
    assert not carried & omitted
    assert carried | omitted == set(EngineProfile.model_fields)


def test_the_default_engine_is_the_shipped_a100_profile_less_its_budget() -> None:
    defaults = load_values(CHART / "values.yaml")
    expected = chart_values(load_profile(ROOT / "deploy" / "profiles" / "gpu-qwen25-7b-a100.yaml"))
    # No default budget (values.yaml says why): vLLM's own default, 0.9 of the GPU, applies.
    expected["engine"]["gpuMemoryUtilization"] = None
    assert {key: defaults["engine"][key] for key in expected["engine"]} == expected["engine"]
    assert defaults["modelSource"]["source"] == expected["modelSource"]["source"]


# ---- lint and schemas -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["defaults", "cpu-smoke", "sweep", "everything-on", "alternatives-on", "cpu-smoke-everything-on"]
)
def test_the_chart_lints_clean_and_every_manifest_validates(name: str, sweep_values: dict[str, Any]) -> None:
    layers = values_sets(sweep_values)[name]
    report = lint(*layers)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems
    docs = manifests(*layers)
    report_by_object = k8s_validation.validate_all(docs)
    assert set(report_by_object) == {k8s_validation.doc_key(doc) for doc in docs}, "every object validated"
    assert not k8s_validation.failures(report_by_object), k8s_validation.failures(report_by_object)


def test_every_optional_feature_renders_its_objects() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for doc in manifests(EVERYTHING_ON)}
    assert kinds >= {
        ("apps/v1", "Deployment"),
        ("v1", "Service"),
        ("v1", "PersistentVolumeClaim"),
        ("v1", "ConfigMap"),
        ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("monitoring.coreos.com/v1", "PrometheusRule"),
        ("keda.sh/v1alpha1", "ScaledObject"),
        ("inference.networking.k8s.io/v1", "InferencePool"),
        ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    }
    alternatives = {(doc["apiVersion"], doc["kind"]) for doc in manifests(ALTERNATIVES_ON)}
    assert {
        ("monitoring.coreos.com/v1", "PodMonitor"),
        ("autoscaling/v2", "HorizontalPodAutoscaler"),
    } <= alternatives
    # The `helm test` pods and their reader's Role are there by default (tests/test_helm_test_pods.py).
    defaults = {
        doc["kind"]
        for doc in manifests()
        if doc["metadata"]["labels"].get("app.kubernetes.io/component") != "release-test"
    }
    assert defaults == {"Deployment", "Service"}, "every optional feature is off by default"


# ---- the engine the chart deploys is the profile kvtune render describes --------------------------------


def _keyed_cpu_profile(tmp_path: Path) -> Path:
    path = tmp_path / "keyed-cpu.yaml"
    path.write_text(yaml.safe_dump({
        "name": "keyed", "device": "cpu", "model": "smollm2-135m", "max_model_len": 2048,
        "dtype": "float32", "kv_cache_memory_bytes": "768MiB", "block_size": 64, "max_num_seqs": 12,
        "enable_chunked_prefill": False, "enforce_eager": True, "cpu_threads_bind": "0-1",
        "shutdown_timeout": 5, "env": {"VLLM_LOGGING_LEVEL": "INFO"}, "secret_env": ["HF_TOKEN"],
        "api_key_env": "ENGINE_KEY", "extra_args": ["--max-logprobs", "5"],
    }))  # fmt: skip
    return path


@pytest.mark.parametrize("profile_name", [p.name for p in PROFILES] + ["keyed-cpu"])
def test_the_engine_container_runs_what_kvtune_render_prints(profile_name: str, tmp_path: Path) -> None:
    path = (
        _keyed_cpu_profile(tmp_path)
        if profile_name == "keyed-cpu"
        else ROOT / "deploy" / "profiles" / profile_name
    )
    # The profile as this host runs it, which is what `kvtune render` prints (an fp8 KV cache may fall back).
    profile = load_profile(path).adapted_to_host()[0]
    render_env, command = render_cli(path)
    container = engine_container(manifests(chart_values(profile)))

    _python, dash_m, module, *render_args = command
    assert container["command"] == ["python3", "-m", module] and (dash_m, module) == ("-m", API_SERVER_MODULE)
    assert without_address(container["args"]) == without_address(render_args)
    assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"  # noqa: S104 (in the pod)
    plain_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert {name: plain_env[name] for name in render_env} == render_env
    from_secrets = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert set(from_secrets) == set(profile.secret_env) | ({"VLLM_API_KEY"} if profile.api_key_env else set())


def test_the_sweep_s_values_install_unchanged_and_deploy_its_winner(sweep_values: dict[str, Any]) -> None:
    values = sweep_values["values"]
    written = load_profile(sweep_values["best"])
    best, fallback = written.adapted_to_host()
    container = engine_container(manifests(values))
    _, command = render_cli(sweep_values["best"])
    args = list(container["args"])
    dtype_at = args.index("--kv-cache-dtype") + 1
    # The chart deploys the winner as written (its nodes decide what their CPUs keep); `kvtune render` prints
    # it as this host runs it, where an fp8 KV cache may fall back.
    assert args[dtype_at] == written.kv_cache_dtype
    if fallback:
        args[dtype_at] = best.kv_cache_dtype
    assert without_address(args) == without_address(command[3:])
    assert "--max-num-seqs" in container["args"] and best.max_num_seqs == 8
    rule = one(manifests(values, {"monitoring": {"prometheusRule": {"enabled": True}}}), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(render_rules(1.5))["groups"], (
        "the sweep's SLO is the alert's"
    )


def test_kvtune_render_as_helm_values_prints_what_the_sweep_writes(tmp_path: Path) -> None:
    path = _keyed_cpu_profile(tmp_path)
    printed = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "render", str(path), "--as", "helm-values",
         "--ttft-slo", "0.75"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    values = yaml.safe_load(printed)
    assert values == chart_values(load_profile(path), ttft_p99_slo_seconds=0.75)
    assert (
        "kubectl create secret generic keyed-api-key" in printed
        and "keyed-env --from-literal=HF_TOKEN" in printed
    )
    assert profile_from_engine(values["engine"]).vllm_args() == load_profile(path).vllm_args()


# ---- bad values -----------------------------------------------------------------------------------------

REFUSED_ENGINE_VALUES: list[tuple[dict[str, Any], str]] = [
    ({"kvCacheDtype": "fp9"}, "/engine/kvCacheDtype"),
    ({"kvCacheMemoryBytes": -1}, "/engine/kvCacheMemoryBytes"),
    ({"gpuMemoryUtilization": 1.5}, "/engine/gpuMemoryUtilization"),
    ({"maxNumSeqs": 0}, "/engine/maxNumSeqs"),
    ({"device": "cpu", "kvCacheMemoryBytes": 1073741824, "blockSize": 48}, "/engine/blockSize"),
    ({"cpuReservedCores": 0}, "/engine/cpuReservedCores"),  # on the default device, cuda
    ({"device": "cpu", "kvCacheMemoryBytes": 1073741824, "kvOffloadingSize": 8}, "/engine/kvOffloadingSize"),
    ({"kvOffloadingBackend": "lmcache"}, "/engine/kvOffloadingBackend"),  # without a size
    ({"kvOffloadingSize": 8, "kvOffloadingBackend": "disk"}, "/engine/kvOffloadingBackend"),
    ({"kvCacheMetricsSample": 0.5}, "/engine/kvCacheMetricsSample"),  # metrics off
    ({"kvCacheMetrics": True, "kvCacheMetricsSample": 0}, "/engine/kvCacheMetricsSample"),
    ({"kvCacheDtyp": "fp8"}, "kvCacheDtyp"),
]


@pytest.mark.parametrize(
    ("engine", "named"), REFUSED_ENGINE_VALUES, ids=[n for _, n in REFUSED_ENGINE_VALUES]
)
def test_bad_engine_values_are_refused_by_the_schema_and_the_profile(
    engine: dict[str, Any], named: str
) -> None:
    message = render_error({"engine": engine})
    assert named in message and "schema" in message, message
    defaults = load_values(CHART / "values.yaml")["engine"]
    with pytest.raises(ValueError):  # the profile's own validators agree
        profile_from_engine({key: value for key, value in (defaults | engine).items() if value is not None})


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (
            {"monitoring": {"prometheusRule": {"ttftP99SloSeconds": 0}}},
            "/monitoring/prometheusRule/ttftP99SloSeconds",
        ),
        ({"locust": {"workload": "chatbot"}}, "/locust/workload"),
        ({"modelSource": {"source": "s3"}}, "/modelSource/source"),
        ({"service": {"port": 70000}}, "/service/port"),
        ({"replica": 2}, "replica"),
        (
            {"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}}},
            "enable hpa or keda, not both",
        ),
        ({"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}, "not both"),
        ({"modelSource": {"source": "pvc"}}, "modelSource.pvc.claimName"),
        ({"inferencePool": {"enabled": True}}, "inferencePool.endpointPicker.serviceName"),
        ({"engine": {"secretEnv": ["HF_TOKEN"]}}, "engine.secretEnvSecret"),
        (  # the two values that conflict, by name and value
            {"engine": {"gpuMemoryUtilization": 0.9, "kvCacheMemoryBytes": 1073741824}},
            "two KV budgets, gpuMemoryUtilization 0.9 and kvCacheMemoryBytes 1073741824; set one of them",
        ),
    ],
)
def test_bad_chart_values_are_refused_naming_the_value(values: dict[str, Any], named: str) -> None:
    message = render_error(values)
    assert named in message, message


def _reads_as(word: str, setting: vllm_parser.Setting) -> bool:
    try:
        flags = vllm_parser.parser().flags([word])
    except vllm_parser.ExtraArgError:  # ambiguous or unknown
        return False
    return bool(flags) and flags[0].setting == setting


def _spelt_otherwise(setting: vllm_parser.Setting) -> list[str]:
    """SETTING's options as written, and by their shortest abbreviations vLLM accepts, in `_`, `=` and
    `.key` forms."""
    words: list[str] = []
    for option in setting.option_strings:
        if len(option) == 2:  # -h: its value may be attached
            words += [option, f"{option}x"]
            continue
        if not option.startswith("--"):  # -tp: abbreviated or not, `=value` after it
            words += [option, f"{option}=1"]
            continue
        shortest = next(option[:n] for n in range(3, len(option) + 1) if _reads_as(option[:n], setting))
        words += [option, shortest, "--" + shortest[2:].replace("-", "_") + "=1", f"{shortest}.key"]
    return words


def test_extra_args_are_refused_by_the_chart_as_by_the_profile() -> None:
    """Every spelling of a flag the chart or an engine value sets, or of one carrying a credential, is
    refused by the chart (Go's regular expressions, generated from vLLM's parser), each naming the word,
    the flag and what to set instead; every other vLLM option passes."""
    refused = refused_settings()
    allowed = [
        option
        for setting in vllm_parser.parser().settings()
        if setting not in refused
        for option in setting.option_strings
    ]
    spelt = [word for setting in refused for word in _spelt_otherwise(setting)]
    assert {"--por", "--api_k=1", "--hf-t.key", "-hx", "--no-enable-pre"} <= set(spelt)
    message = render_error({"engine": {"extraArgs": allowed + spelt}})
    failed = {int(index) for index in re.findall(r"\[(\d+)\] \"", message)}
    assert failed == set(range(len(allowed), len(allowed) + len(spelt))), message
    owned = "which an engine value sets; remove it and set"
    for word, fix in [
        ("--max-num-seqs", f"vLLM's --max-num-seqs, {owned} engine.maxNumSeqs"),
        ("--kv-cache-dtype=fp8", f"vLLM's --kv-cache-dtype, {owned} engine.kvCacheDtype"),
        ("--port", "vLLM's --port, which the chart sets"),
        ("--host", "vLLM's --host, which the chart sets"),
        ("-tp", "set engine.tensorParallelSize instead"),
    ]:
        answer = render_error({"engine": {"extraArgs": ["--seed", "1", word, "8"]}})
        assert f'engine.extraArgs: [2] "{word.split("=")[0]}' in answer and fix in answer, answer
    shown = render_error({"engine": {"extraArgs": ["--kv-cache-dtype=fp8"]}})
    assert "fp8" not in shown.split("is vLLM's")[0], "a value after = is never shown (it may be a credential)"
    container = engine_container(manifests({"engine": {"extraArgs": ["--seed", "1", "--max_logprobs=5"]}}))
    assert container["args"][-2:] == ["1", "--max_logprobs=5"]


# ---- what the objects carry -----------------------------------------------------------------------------


@pytest.mark.parametrize("slo", [2.0, 0.5, 1.25])
def test_the_prometheus_rule_is_the_project_s_rules_at_the_chosen_slo(slo: float) -> None:
    rule = one(
        manifests({"monitoring": {"prometheusRule": {"enabled": True, "ttftP99SloSeconds": slo}}}),
        "PrometheusRule",
    )
    assert rule["spec"]["groups"] == yaml.safe_load(render_rules(slo))["groups"]
    if slo == 2.0:
        shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "kvtune-alerts.yaml").read_text())
        assert rule["spec"]["groups"] == shipped["groups"]


def test_the_dashboards_are_configmaps_for_grafana_s_sidecar() -> None:
    docs = [
        doc
        for doc in manifests({"monitoring": {"dashboards": {"enabled": True}}})
        if doc["kind"] == "ConfigMap"
    ]
    shipped = {path.name: path.read_text() for path in (ROOT / "dashboards").glob("*.json")}
    assert {name: text for doc in docs for name, text in doc["data"].items()} == {
        name: text.rstrip("\n") for name, text in shipped.items()
    }
    assert all(doc["metadata"]["labels"]["grafana_dashboard"] == "1" for doc in docs)


def test_probes_give_a_slow_model_load_its_time_without_an_initial_delay() -> None:
    container = engine_container(manifests({"engine": {"readyTimeoutS": 2400}}))
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2400
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert "initialDelaySeconds" not in container[probe]


def test_a_values_change_rolls_the_pods_and_an_unrelated_one_does_not() -> None:
    def checksum(*layers: dict[str, Any]) -> str:
        deployment = one(manifests(*layers), "Deployment", f"{RELEASE}-kvtune")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    base = checksum()
    assert checksum({"engine": {"maxNumSeqs": 128}}) != base
    assert checksum({"engine": {"kvCacheDtype": "fp8"}}) != base
    assert checksum({"monitoring": {"dashboards": {"enabled": True}}}) == base


def test_the_pod_runs_as_non_root_with_writable_homes() -> None:
    docs = manifests(CPU_SMOKE)
    pod = one(docs, "Deployment", f"{RELEASE}-kvtune")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in engine_container(docs)["env"]}
    mounts = {m["mountPath"] for m in engine_container(docs)["volumeMounts"]}
    assert env["HOME"] == "/cache" and "/cache" in mounts and "/dev/shm" in mounts
    (init,) = pod["initContainers"]
    assert init["command"][-2:] == ["/opt/kvtune/models/smollm2-135m", "/models/"]


def test_kv_events_publish_for_the_scheduler_with_the_pod_s_address_in_the_topic() -> None:
    container = engine_container(manifests({"kvEvents": {"enabled": True}}))
    config = json.loads(container["args"][container["args"].index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "topic": "kv@$(POD_IP)@Qwen/Qwen2.5-7B-Instruct"}  # fmt: skip
    assert any(e["name"] == "POD_IP" for e in container["env"]), "Kubernetes expands $(POD_IP) from the env"
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in container["ports"]


def test_locust_targets_the_engine_service_and_notes_say_how_to_reach_everything() -> None:
    docs = manifests(CPU_SMOKE, {"engine": {"apiKeySecret": {"name": "key", "key": "api-key"}}})
    master = one(docs, "Deployment", f"{RELEASE}-kvtune-locust-master")["spec"]["template"]["spec"][
        "containers"
    ][0]
    args = master["args"]
    assert args[args.index("--host") + 1] == f"http://{RELEASE}-kvtune.llm.svc:8000"
    assert args[:2] == ["-f", "/opt/kvtune/loadtests/shared_prefix.py"]
    assert {
        "name": "KVTUNE_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "key", "key": "api-key"}},
    } in master["env"]
    text = notes(CPU_SMOKE, {"monitoring": {"dashboards": {"enabled": True}}})
    assert f"port-forward service/{RELEASE}-kvtune 8000:8000" in text
    assert f"port-forward service/{RELEASE}-kvtune-locust 8089:8089" in text and "grafana_dashboard" in text


def test_kvtune_s_image_carries_what_the_chart_expects_in_it() -> None:
    """The Dockerfile cannot be built here (no container engine): its paths are checked against the chart."""
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"KVTUNE_CACHE_DIR={IMAGE_CACHE_DIR}" in dockerfile, "embedded models under /opt/kvtune/models"
    for name in EMBEDDED_MODELS:
        assert f"kvtune model prepare {name}" in dockerfile
    assert "COPY loadtests /opt/kvtune/loadtests" in dockerfile
    for workload in get_args(Locust.model_fields["workload"].annotation):
        assert (ROOT / "loadtests" / f"{workload}.py").is_file(), f"locust.workload {workload} has no file"
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), (
                    f"the Dockerfile copies {source}, which is not in the project"
                )
