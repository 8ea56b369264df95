"""The chart on a GPU cluster, rendered by Helm's engine and validated against the Kubernetes and CRD schemas:
tensor and pipeline parallel engines with their GPU limits, resources that keep the GPU, the pod-spec options
clusters require, several models in one release, pinned revisions and object storage, in-cluster warm-up, long
release names, and every value that installs but breaks on the cluster refused before install.

GPU figures are checked against numbers worked out by hand in the comments, not against the code under test.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.helm.values import chart_values
from kvtune.profile import load_profile
from kvtune.sweep.spec import load_spec
from tests import k8s_validation
from tests.helm_chart import (
    POD_OPTIONS,
    RELEASE,
    ROOT,
    engine_container,
    lint,
    manifests,
    one,
    render_cli,
    render_error,
    without_address,
)

PROFILES = ROOT / "deploy" / "profiles"
TP4 = PROFILES / "gpu-llama31-70b-h100-tp4.yaml"
TP2_PP2 = PROFILES / "gpu-llama31-70b-a100-tp2pp2.yaml"
SMALL = PROFILES / "gpu-llama31-8b-h100.yaml"
# Llama 3.1 70B: 70,553,706,496 parameters x 2 bytes = 141,107,412,992 bytes = 131.42 GiB -> 132 GiB.
WEIGHTS_70B_GIB = 132
# Llama 3.1 8B: 8,030,261,248 x 2 = 16,060,522,496 bytes = 14.96 GiB -> 15 GiB.
WEIGHTS_8B_GIB = 15


def values_of(profile: Path) -> dict[str, Any]:
    """What `kvtune render PROFILE --as helm-values` prints for it."""
    return chart_values(load_profile(profile))


def pod_spec(docs: list[dict[str, Any]], name: str = f"{RELEASE}-kvtune") -> dict[str, Any]:
    template: dict[str, Any] = one(docs, "Deployment", name)["spec"]["template"]
    spec: dict[str, Any] = template["spec"]
    return spec


def vllm(spec: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    assert isinstance(container, dict)
    return container


def valid(docs: list[dict[str, Any]]) -> None:
    report = k8s_validation.validate_all(docs)
    assert set(report) == {k8s_validation.doc_key(doc) for doc in docs}, "every object validated"
    assert not k8s_validation.failures(report), k8s_validation.failures(report)


def lints_clean(*layers: dict[str, Any]) -> None:
    report = lint(*layers)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- tensor and pipeline parallel -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "tp", "pp"), [(TP4, "4", None), (TP2_PP2, "2", "2")], ids=["tp4", "tp2-pp2"]
)
def test_a_parallel_engine_gets_one_gpu_per_rank_and_its_flags(
    profile: Path, tp: str, pp: str | None
) -> None:
    docs = manifests(values_of(profile))
    valid(docs)
    container = engine_container(docs)
    assert flag(container["args"], "--tensor-parallel-size") == tp
    assert ("--pipeline-parallel-size" in container["args"]) == (pp is not None)
    if pp:
        assert flag(container["args"], "--pipeline-parallel-size") == pp
    # GPUs = TP x PP = 4 either way; requests sized from the weights by hand: 132 GiB + 4 GiB + 2 GiB x 4
    # GPUs = 144 GiB, CPUs 2 x 4 + 2 = 10.
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": 4},
        "requests": {"cpu": "10", "memory": f"{WEIGHTS_70B_GIB + 4 + 2 * 4}Gi"},
    }
    # The round trip: the pod runs what `kvtune render --format argv` prints for the profile.
    _, command = render_cli(profile)
    assert without_address(container["args"]) == without_address(command[3:])


def test_data_parallel_multiplies_the_gpus_and_a_mig_resource_name_is_used_as_given() -> None:
    values = {
        "engine": {"tensorParallelSize": 2, "dataParallelSize": 2},
        "gpuResourceName": "nvidia.com/mig-3g.40gb",
    }
    container = engine_container(manifests(values))
    assert container["resources"]["limits"] == {"nvidia.com/mig-3g.40gb": 4}


def test_resources_the_user_gives_keep_the_gpu_limit() -> None:
    given = {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "96Gi"}}
    container = engine_container(manifests(values_of(TP4), {"resources": given}))
    assert container["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"memory": "96Gi", "nvidia.com/gpu": 4},
    }
    # The same count written out is accepted; another count is refused naming both.
    same = {"limits": {"nvidia.com/gpu": 4}}
    assert engine_container(manifests(values_of(TP4), {"resources": same}))["resources"]["limits"] == {
        "nvidia.com/gpu": 4
    }
    message = render_error(values_of(TP4), {"resources": {"limits": {"nvidia.com/gpu": 2}}})
    assert "resources.limits.nvidia.com/gpu is 2, but the engine runs 4 rank(s)" in message, message


def test_default_requests_follow_the_model_and_a_cpu_engine_its_kv_pool() -> None:
    # 8B on one GPU: 15 GiB + 4 + 2 = 21 GiB, 2 + 2 = 4 CPUs.
    small = engine_container(manifests(values_of(SMALL)))["resources"]
    assert small["requests"] == {"cpu": "4", "memory": f"{WEIGHTS_8B_GIB + 4 + 2}Gi"}
    # A model kvtune does not know counts as 16 GiB: 16 + 4 + 2 = 22 GiB.
    unknown = engine_container(manifests({"engine": {"model": "acme/unknown-7b"}}))["resources"]
    assert unknown["requests"]["memory"] == "22Gi"
    # CPU: the 1 GiB KV pool + SmolLM2's 269,030,016 bytes of weights + 2 GiB = 3,490,285,440 bytes
    # = 3328.6 MiB -> 3329 MiB; no GPU.
    cpu = {
        "engine": {
            "device": "cpu",
            "model": "smollm2-135m",
            "kvCacheMemoryBytes": 1073741824,
            "blockSize": 128,
        }
    }
    resources = engine_container(manifests(cpu, {"modelSource": {"source": "embedded"}}))["resources"]
    assert resources == {"requests": {"cpu": "2", "memory": "3329Mi"}}


# ---- pod-spec options ------------------------------------------------------------------------------------


def test_every_pod_spec_option_lands_in_the_pod_and_validates() -> None:
    lints_clean(values_of(TP4), POD_OPTIONS)
    docs = manifests(values_of(TP4), POD_OPTIONS)
    valid(docs)
    spec = pod_spec(docs)
    assert spec["runtimeClassName"] == "nvidia" and spec["priorityClassName"] == "inference-critical"
    assert spec["serviceAccountName"] == "model-reader"
    assert {"name": "certs", "secret": {"secretName": "corp-ca"}} in spec["volumes"]
    assert {"name": "certs", "mountPath": "/etc/ssl/corp", "readOnly": True} in vllm(spec)["volumeMounts"]
    assert [c["name"] for c in spec["initContainers"]] == ["wait"]
    # Pod Security "restricted" wants a seccomp profile.
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    pdb = one(docs, "PodDisruptionBudget", f"{RELEASE}-kvtune")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert (
        pdb["spec"]["selector"]["matchLabels"] == one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert one(docs, "ConfigMap", "site-notes")["data"] == {"a": "b"}
    one(docs, "ServiceAccount", f"{RELEASE}-extra")  # the text was templated


def test_keda_scales_down_as_slowly_as_the_hpa() -> None:
    scaled = one(manifests({"autoscaling": {"keda": {"enabled": True}}}), "ScaledObject")
    hpa = one(manifests({"autoscaling": {"hpa": {"enabled": True}}}), "HorizontalPodAutoscaler")
    keda_window = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert keda_window == hpa["spec"]["behavior"]["scaleDown"] == {"stabilizationWindowSeconds": 600}


def test_fp8_kv_on_cpu_nodes_selects_avx512_nodes_from_node_feature_discovery() -> None:
    cpu = {"device": "cpu", "model": "smollm2-135m", "kvCacheMemoryBytes": 1073741824, "blockSize": 128}
    fp8 = pod_spec(manifests({"engine": cpu | {"kvCacheDtype": "fp8"}, "nodeSelector": {"pool": "cpu"}}))
    assert fp8["nodeSelector"] == {"pool": "cpu", "feature.node.kubernetes.io/cpu-cpuid.AVX512F": "true"}
    assert "nodeSelector" not in pod_spec(manifests({"engine": cpu}))
    off = {"engine": cpu | {"kvCacheDtype": "fp8"}, "cpuFeatureNodeSelector": False}
    assert "nodeSelector" not in pod_spec(manifests(off))


# ---- model sources ---------------------------------------------------------------------------------------


def test_a_pinned_revision_reaches_the_engine_and_locust_s_tokenizer() -> None:
    sha = "a09a35458c702b33eeacc393d103063234e8bc28"
    values = {"engine": {"revision": sha}, "locust": {"enabled": True}}
    docs = manifests(values)
    valid(docs)
    assert flag(engine_container(docs)["args"], "--revision") == sha
    master = one(docs, "Deployment", f"{RELEASE}-kvtune-locust-master")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in master["containers"][0]["env"]}
    assert env["KVTUNE_TOKENIZER"] == "Qwen/Qwen2.5-7B-Instruct" and env["KVTUNE_TOKENIZER_REVISION"] == sha


def test_object_storage_streams_the_weights_with_vllm_s_run_ai_loader() -> None:
    values = {
        "engine": {"model": "s3://models/llama-3.1-8b-instruct", "loadFormat": "runai_streamer"},
        "modelSource": {
            "source": "objectStorage",
            "objectStorage": {"credentialsSecret": "s3-creds", "endpointUrl": "http://minio.storage:9000"},
        },
        "locust": {"enabled": True, "tokenizer": "meta-llama/Llama-3.1-8B-Instruct"},
    }
    docs = manifests(values)
    valid(docs)
    container = engine_container(docs)
    assert flag(container["args"], "--model") == "s3://models/llama-3.1-8b-instruct"
    assert flag(container["args"], "--load-format") == "runai_streamer"
    env = {e["name"]: e for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds",
        "key": "AWS_ACCESS_KEY_ID",
    }
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert "HF_TOKEN" not in env
    message = render_error({"modelSource": {"source": "objectStorage"}, "engine": {"model": "s3://m/x"}})
    assert "engine.loadFormat must be runai_streamer" in message, message
    message = render_error(values, {"engine": {"model": "models/llama"}})
    assert 'engine.model "models/llama": modelSource.source objectStorage loads gs:// or s3://' in message
    message = render_error(values, {"locust": {"tokenizer": ""}})
    assert "locust.tokenizer: Locust cannot read the weights' object storage" in message, message


def test_locust_tokenises_from_the_engine_s_volume_and_its_token_secret() -> None:
    values = {
        "modelSource": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "qwen"}},
        "engine": {"secretEnv": ["HF_TOKEN"], "secretEnvSecret": "engine-env"},
        "locust": {"enabled": True, "workers": 1},
    }
    docs = manifests(values)
    valid(docs)
    for role in ("master", "worker"):
        spec = one(docs, "Deployment", f"{RELEASE}-kvtune-locust-{role}")["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["KVTUNE_TOKENIZER"]["value"] == "/models/qwen"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "engine-env", "key": "HF_TOKEN"}
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
        assert spec["volumes"] == [
            {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}}
        ]


# ---- in-cluster warm-up ----------------------------------------------------------------------------------


def test_the_profile_s_warmup_prefixes_are_sent_by_the_pod_s_post_start_hook(tmp_path: Path) -> None:
    system = tmp_path / "system.txt"
    system.write_text("You are the support assistant of ACME. " * 30)
    profile = tmp_path / "warm.yaml"
    source = yaml.safe_load(TP4.read_text())
    profile.write_text(
        yaml.safe_dump(source | {"warmup": [{"file": "system.txt"}, {"role": "raw", "text": "Context: "}]})
    )
    values = chart_values(load_profile(profile))
    docs = manifests(values, {"engine": {"apiKeySecret": {"name": "key", "key": "api-key"}}})
    valid(docs)
    spec = pod_spec(docs)
    container = vllm(spec)
    hook = container["lifecycle"]["postStart"]["exec"]["command"]
    assert hook == ["python3", "-I", "/etc/kvtune/warmup/warmup_hook.py", "/etc/kvtune/warmup/prefixes.json"]
    assert {"name": "warmup", "mountPath": "/etc/kvtune/warmup", "readOnly": True} in container[
        "volumeMounts"
    ]
    config = one(docs, "ConfigMap", f"{RELEASE}-kvtune-warmup")
    assert {"name": "warmup", "configMap": {"name": config["metadata"]["name"]}} in spec["volumes"]
    # The file's text inlined, in the profile's order; the hook reads the key from the container's env.
    assert json.loads(config["data"]["prefixes.json"]) == {
        "model": "meta-llama/Llama-3.1-70B-Instruct",
        "readyTimeoutS": 3600,
        "prefixes": [{"role": "system", "text": system.read_text()}, {"role": "raw", "text": "Context: "}],
    }
    hook_source = (ROOT / "kvtune" / "helm" / "warmup_hook.py").read_text()
    assert config["data"]["warmup_hook.py"].endswith(hook_source)
    assert any(e["name"] == "VLLM_API_KEY" for e in container["env"])
    # No prefixes, no hook.
    assert "lifecycle" not in engine_container(manifests(values_of(TP4)))


# ---- several models in one release -----------------------------------------------------------------------


def own_picker(name: str) -> dict[str, Any]:
    """An engine's own endpoint picker (one per InferencePool)."""
    return {"inferencePool": {"endpointPicker": {"serviceName": f"epp-{name}"}}}


def two_models() -> dict[str, Any]:
    return {
        "engines": [
            {"name": "large", **values_of(TP4), **own_picker("large")},
            {
                "name": "small",
                **values_of(SMALL),
                **own_picker("small"),
                "replicas": 2,
                "nodeSelector": {"gpu": "h100"},
            },
        ],
        "monitoring": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
        "inferencePool": {
            "enabled": True,
            "httpRoute": {"enabled": True, "gatewayName": "gw"},
        },
        "podDisruptionBudget": {"enabled": True},
        "locust": {"enabled": True, "engine": "small"},
    }


def test_two_models_in_one_release_each_get_their_own_objects_and_run_their_profile() -> None:
    lints_clean(two_models())
    docs = manifests(two_models())
    valid(docs)
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in docs}
    for engine in ("large", "small"):
        for kind in (
            "Deployment",
            "Service",
            "ServiceMonitor",
            "InferencePool",
            "HTTPRoute",
            "PodDisruptionBudget",
        ):
            assert (kind, f"{RELEASE}-kvtune-{engine}") in names
    assert ("Deployment", f"{RELEASE}-kvtune") not in names, "no top-level engine beside the listed ones"
    assert Counter(kind for kind, _ in names)["PrometheusRule"] == 1, "one set of alerts for the release"
    selectors = {}
    for engine, profile, gpus in (("large", TP4, 4), ("small", SMALL, 1)):
        deployment = one(docs, "Deployment", f"{RELEASE}-kvtune-{engine}")
        selectors[engine] = deployment["spec"]["selector"]["matchLabels"]
        assert selectors[engine]["kvtune.io/engine"] == engine
        service = one(docs, "Service", f"{RELEASE}-kvtune-{engine}")
        assert service["spec"]["selector"] == selectors[engine]
        container = vllm(deployment["spec"]["template"]["spec"])
        _, command = render_cli(profile)
        assert without_address(container["args"]) == without_address(command[3:])
        assert container["resources"]["limits"] == {"nvidia.com/gpu": gpus}
        route = one(docs, "HTTPRoute", f"{RELEASE}-kvtune-{engine}")["spec"]["rules"][0]
        assert route["matches"][0]["headers"][0]["value"] == load_profile(profile).api_model_name
    assert one(docs, "Deployment", f"{RELEASE}-kvtune-small")["spec"]["replicas"] == 2
    assert pod_spec(docs, f"{RELEASE}-kvtune-small")["nodeSelector"] == {"gpu": "h100"}
    assert "nodeSelector" not in pod_spec(docs, f"{RELEASE}-kvtune-large")
    master = one(docs, "Deployment", f"{RELEASE}-kvtune-locust-master")["spec"]["template"]["spec"]
    args = master["containers"][0]["args"]
    assert flag(args, "--host") == f"http://{RELEASE}-kvtune-small.llm.svc:8000"


def test_the_release_tests_check_every_engine() -> None:
    docs = manifests(two_models())
    pods = {doc["metadata"]["name"] for doc in docs if doc["kind"] == "Pod"}
    for engine in ("large", "small"):
        assert {
            f"{RELEASE}-kvtune-{engine}-test-{check}" for check in ("rollout", "health", "completion")
        } <= pods
    assert f"{RELEASE}-kvtune-small-test-locust" in pods and f"{RELEASE}-kvtune-large-test-locust" not in pods


def test_an_engine_item_overrides_the_top_level_values_key_by_key_null_included() -> None:
    values = {
        "engine": {"maxNumSeqs": 64, "blockSize": 32},
        "engines": [{"name": "a", "engine": {"model": "Qwen/Qwen2.5-7B-Instruct", "maxNumSeqs": None}}],
    }
    args = vllm(pod_spec(manifests(values), f"{RELEASE}-kvtune-a"))["args"]
    assert "--max-num-seqs" not in args, "the item's null is vLLM's default, not the top-level 64"
    assert flag(args, "--block-size") == "32", "what the item leaves out comes from the top level"


# ---- long release names ----------------------------------------------------------------------------------

RELEASE_53 = "r" * 41 + "-inference-x"  # Helm's longest release name: 53 characters


def test_a_53_character_release_name_gives_names_kubernetes_accepts_and_no_two_alike() -> None:
    assert len(RELEASE_53) == 53
    everything = two_models() | {
        "monitoring": {"serviceMonitor": {"enabled": True}, "dashboards": {"enabled": True}},
        # Room for the 70B model's 131.4 GiB of weights (and 2 GiB of compile caches).
        "cache": {"enabled": True, "accessModes": ["ReadWriteMany"], "size": "140Gi"},
        "engine": {"warmup": [{"role": "system", "text": "Be brief."}]},
        "locust": {"enabled": True, "workers": 1},
    }
    for values in (
        {"locust": {"enabled": True, "workers": 1}, "monitoring": {"dashboards": {"enabled": True}}},
        everything,
    ):
        docs = manifests(values, name=RELEASE_53)
        valid(docs)
        names = [(doc["kind"], doc["metadata"]["name"]) for doc in docs]
        assert all(len(name) <= 63 for _, name in names), [n for _, n in names if len(n) > 63]
        assert len(set(names)) == len(names), [n for n, count in Counter(names).items() if count > 1]
        for doc in docs:
            labels = doc["metadata"].get("labels", {})
            assert all(len(str(value)) <= 63 for value in labels.values())


# ---- values that install but break on the cluster --------------------------------------------------------

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    (
        "rwo-cache-two-replicas",
        {"cache": {"enabled": True}, "replicas": 2},
        "cache.accessModes [ReadWriteOnce] with up to 2 pods: a ReadWriteOnce volume attaches to one node",
    ),
    (
        "rwo-cache-autoscaled",
        {"cache": {"enabled": True}, "autoscaling": {"hpa": {"enabled": True, "maxReplicas": 3}}},
        "with up to 3 pods",
    ),
    (
        "keda-min-above-max",
        {"autoscaling": {"keda": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
        "autoscaling.keda.minReplicas 5 is above maxReplicas 2",
    ),
    (
        "hpa-min-above-max",
        {"autoscaling": {"hpa": {"enabled": True, "minReplicas": 3, "maxReplicas": 1}}},
        "autoscaling.hpa.minReplicas 3 is above maxReplicas 1",
    ),
    (
        "keda-min-zero",
        {"autoscaling": {"keda": {"enabled": True, "minReplicas": 0}}},
        "autoscaling.keda.minReplicas 0: the trigger reads autoscaling.signal from the engine's own metrics",
    ),
    ("shm-not-a-quantity", {"shmSize": "8GB"}, 'shmSize "8GB" is not a Kubernetes quantity: write it as 8Gi'),
    ("empty-model", {"engine": {"model": ""}}, "engine.model is empty: name the model"),
    (
        "token-in-env",
        {"engine": {"env": {"HF_TOKEN": "x"}}},
        "engine.env.HF_TOKEN looks like a credential, and values are stored in plain text in the release; "
        "list HF_TOKEN under engine.secretEnv",
    ),
    (
        "short-timeout-first-download",
        {"engine": {"readyTimeoutS": 60}},
        "engine.readyTimeoutS 60: a first start downloads the weights from the hub",
    ),
    (
        "typed-flag-in-extra-args",
        {"engine": {"extraArgs": ["--max-num-seqs", "4"]}},
        'engine.extraArgs: [0] "--max-num-seqs" is vLLM\'s --max-num-seqs, which an engine value sets',
    ),
    (
        "chart-flag-in-extra-args",
        {"engine": {"extraArgs": ["--port=9000"]}},
        'engine.extraArgs: [0] "--port=..." is vLLM\'s --port, which the chart sets',
    ),
    (
        "two-budgets",
        {"engine": {"gpuMemoryUtilization": 0.8, "kvCacheMemoryBytes": 2147483648}},
        "engine: two KV budgets, gpuMemoryUtilization 0.8 and kvCacheMemoryBytes 2147483648",
    ),
    (
        "two-engines-one-name",
        {"engines": [{"name": "a", "engine": {"model": "m/x"}}, {"name": "a", "engine": {"model": "m/y"}}]},
        'engines: two engines are named "a"',
    ),
    (
        "error-in-an-item",
        {"engines": [{"name": "ok", "engine": {"model": "m/x"}}, {"name": "bad", "shmSize": "1 GiB"}]},
        'engines[bad].shmSize "1 GiB" is not a Kubernetes quantity',
    ),
    (
        "shared-rwo-claim",
        {
            "cache": {"enabled": True, "existingClaim": "hf-cache"},
            "engines": [{"name": "a", "engine": {"model": "m/x"}}, {"name": "b", "engine": {"model": "m/y"}}],
        },
        'cache.existingClaim "hf-cache" is used by engines a and b',
    ),
    (
        "locust-engine-unknown",
        {"locust": {"enabled": True, "engine": "chat"}},
        'locust.engine: "chat" is not one of the release\'s engines',
    ),
]


@pytest.mark.parametrize(("values", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_values_a_cluster_would_break_on_are_refused_before_install(
    values: dict[str, Any], message: str
) -> None:
    refused = render_error(values)
    assert message in refused, refused


def test_an_engine_name_must_name_kubernetes_objects() -> None:
    message = render_error({"engines": [{"name": "Large_Model", "engine": {"model": "m/x"}}]})
    assert "/engines/0/name" in message, message


# ---- the sweep Job ---------------------------------------------------------------------------------------


def sweep_values(**changes: Any) -> dict[str, Any]:
    spec = yaml.safe_load((ROOT / "deploy" / "sweeps" / "gpu-llama31-8b-h100.yaml").read_text())
    job = {
        "enabled": True,
        "spec": spec,
        "baseProfile": yaml.safe_load(TP4.read_text()),
        "parallelism": 3,
        "storage": {"secretName": "sweep-db"},
        "resultsClaim": "sweep-results",
    }
    return {"sweep": job | changes}


def test_the_sweep_job_runs_workers_of_one_study_with_the_profile_s_gpus(tmp_path: Path) -> None:
    lints_clean(sweep_values())
    docs = manifests(sweep_values())
    valid(docs)
    job = one(docs, "Job", f"{RELEASE}-kvtune-sweep")
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 3
    pod = job["spec"]["template"]["spec"]
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"] == {"nvidia.com/gpu": 4}, "TP 4: four GPUs per worker pod"
    assert worker["command"][:4] == ["kvtune", "sweep", "/etc/kvtune/sweep/spec.yaml", "--storage"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in worker["env"] if "valueFrom" in e}
    assert env["KVTUNE_SWEEP_STORAGE"] == {"name": "sweep-db", "key": "url"}
    assert env["PGPASSWORD"] == {"name": "sweep-db", "key": "PGPASSWORD", "optional": True}
    assert {"name": "results", "persistentVolumeClaim": {"claimName": "sweep-results"}} in pod["volumes"]
    # The ConfigMap's files are a spec kvtune loads as they are (the base profile beside it).
    config = one(docs, "ConfigMap", f"{RELEASE}-kvtune-sweep")
    for name, text in config["data"].items():
        (tmp_path / name).write_text(text)
    spec = load_spec(tmp_path / "spec.yaml")
    assert spec.base().tensor_parallel_size == 4 and spec.name == "gpu-llama31-8b-chat"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"parallelism": 0}, "/sweep/parallelism"),
        (
            {"storage": {"secretName": ""}},
            "sweep.storage.secretName: name the Secret holding the study's storage",
        ),
        ({"spec": {}}, "sweep.spec: give the sweep spec to run"),
    ],
)
def test_bad_sweep_job_values_are_refused_naming_the_value(changes: dict[str, Any], message: str) -> None:
    refused = render_error(sweep_values(**changes))
    assert message in refused, refused
