"""Chart values that render and pass the schema's types but would break on a cluster, refused by the chart
before install (through Helm's own engine), each message naming the value, its numbers and the fix.

Where a rule has a space of inputs they are generated: names against Kubernetes' name rules, parallel sizes
against kvtune's own model arithmetic (and the profile `kvtune render` loads), quantities in every unit
against byte counts worked out here. A two-model release is shown reachable under its own names.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvtune import kv_math
from kvtune.helm import object_storage
from kvtune.helm.removed_keys import REMOVED_KEYS
from kvtune.helm.values import ChartValues, profile_from_engine
from kvtune.platform import CPU_COMPILE_ENV
from tests import k8s_validation
from tests.helm_chart import (
    CHART,
    RELEASE,
    at_path,
    engine_container,
    load_values,
    manifests,
    merged,
    one,
    render_error,
)

# A render takes 30-100 ms in process: a couple of dozen examples per rule through Helm keep the file within
# seconds; the name rules are also checked on the values model (the schema's source) with many more.
RENDERS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
GIB = 1024**3
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"
DEFAULT_VALUES: dict[str, Any] = load_values(CHART / "values.yaml")
DEFAULT_ENGINE: dict[str, Any] = DEFAULT_VALUES["engine"]


def valid(docs: list[dict[str, Any]]) -> None:
    report = k8s_validation.validate_all(docs)
    assert not k8s_validation.failures(report), k8s_validation.failures(report)


def deployment(docs: list[dict[str, Any]], engine: str = "") -> dict[str, Any]:
    name = f"{RELEASE}-kvtune" + (f"-{engine}" if engine else "")
    found: dict[str, Any] = one(docs, "Deployment", name)
    return found


def vllm(docs: list[dict[str, Any]], engine: str = "") -> dict[str, Any]:
    (container,) = [
        c for c in deployment(docs, engine)["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"
    ]
    assert isinstance(container, dict)
    return container


def arg(container: dict[str, Any], flag: str) -> str | None:
    args: list[str] = container["args"]
    return args[args.index(flag) + 1] if flag in args else None


def picker(name: str) -> dict[str, Any]:
    return {"inferencePool": {"endpointPicker": {"serviceName": f"epp-{name}"}}}


# ---- several models: their own names, their own pickers --------------------------------------------------

ROUTED = {"inferencePool": {"enabled": True, "httpRoute": {"enabled": True, "gatewayName": "gw"}}}


def test_two_models_are_served_and_routed_under_their_own_names() -> None:
    sha = "a09a35458c702b33eeacc393d103063234e8bc28"
    values = ROUTED | {
        # The top-level engine's name and revision are its model's, not the items' that name another.
        "engine": {"servedModelName": "house-chat", "revision": sha},
        "engines": [
            {"name": "llama", "engine": {"model": LLAMA_8B}, **picker("llama")},
            {"name": "qwen", "engine": {"model": QWEN_7B, "servedModelName": "qwen-chat"}, **picker("qwen")},
            {"name": "house", **picker("house")},  # no model of its own: the top-level model, name, revision
        ],
    }
    docs = manifests(values)
    valid(docs)
    routes = {
        engine: one(docs, "HTTPRoute", f"{RELEASE}-kvtune-{engine}")["spec"]["rules"][0]
        for engine in ("llama", "qwen", "house")
    }
    header = {engine: rule["matches"][0]["headers"][0]["value"] for engine, rule in routes.items()}
    assert header == {"llama": LLAMA_8B, "qwen": "qwen-chat", "house": "house-chat"}
    assert len(set(header.values())) == 3, "each model reachable through the Gateway by its own name"
    for engine, rule in routes.items():
        assert rule["backendRefs"][0]["name"] == f"{RELEASE}-kvtune-{engine}", "each route to its own pool"
        assert arg(vllm(docs, engine), "--served-model-name") == header[engine]
    assert arg(vllm(docs, "llama"), "--revision") is None, "another model's revision is not the item's"
    assert arg(vllm(docs, "house"), "--revision") == sha
    pools = {doc["metadata"]["name"]: doc["spec"]["endpointPickerRef"]["name"] for doc in docs
             if doc["kind"] == "InferencePool"}  # fmt: skip
    assert len(set(pools.values())) == 3


def test_an_item_with_its_own_model_keeps_its_own_folder_on_the_model_volume() -> None:
    values = {
        "modelSource": {"source": "pvc", "pvc": {"claimName": "weights", "subPath": "qwen"}},
        "engines": [{"name": "qwen"}, {"name": "llama", "engine": {"model": "llama-3.1-8b"}}],
    }
    docs = manifests(values)
    assert arg(vllm(docs, "qwen"), "--model") == "/models/qwen"
    assert arg(vllm(docs, "llama"), "--model") == "/models/llama-3.1-8b", "not the top-level model's folder"


@pytest.mark.parametrize(
    "engines",
    [
        [{"name": "a", "engine": {"model": LLAMA_8B}}, {"name": "b", "engine": {"model": LLAMA_8B}}],
        [
            {"name": "a", "engine": {"model": LLAMA_8B}},
            {"name": "b", "engine": {"model": QWEN_7B, "servedModelName": LLAMA_8B}},
        ],
        [{"name": "a"}, {"name": "b"}],
    ],
    ids=["one-model-twice", "a-name-that-is-another-s-model", "both-inherit"],
)
def test_two_engines_under_one_served_name_are_refused(engines: list[dict[str, Any]]) -> None:
    message = render_error({"engines": engines})
    assert "engines[a] and engines[b] both serve under the name" in message, message
    assert "set engines[b].engine.servedModelName to a name of its own" in message


def test_two_inference_pools_with_one_endpoint_picker_are_refused() -> None:
    engines: list[dict[str, Any]] = [
        {"name": "a", "engine": {"model": LLAMA_8B}},
        {"name": "b", "engine": {"model": QWEN_7B}},
    ]
    shared = ROUTED | {"inferencePool": ROUTED["inferencePool"] | {"endpointPicker": {"serviceName": "epp"}}}
    message = render_error(shared | {"engines": engines})
    assert 'engines[a] and engines[b] both name the endpoint picker "epp": a picker serves one ' in message
    assert "set engines[b].inferencePool.endpointPicker.serviceName" in message, message
    engines[1] |= picker("b")
    assert len([d for d in manifests(shared | {"engines": engines}) if d["kind"] == "InferencePool"]) == 2


# ---- the model's geometry, as kvtune render judges it ---------------------------------------------------


@RENDERS
@given(
    model=st.sampled_from(sorted(kv_math.KNOWN_MODELS)),
    tp=st.integers(1, 64),
    pp=st.one_of(st.integers(1, 4), st.integers(1, 64)),
)
def test_parallel_sizes_are_refused_exactly_where_kvtune_s_arithmetic_refuses_them(
    model: str, tp: int, pp: int
) -> None:
    engine = {"model": model, "tensorParallelSize": tp, "pipelineParallelSize": pp, "maxModelLen": 2048}
    problem = kv_math.KNOWN_MODELS[model].parallel_problem(tp, pp)
    try:
        profile_from_engine(DEFAULT_ENGINE | engine)
        profile_refuses = False
    except ValueError:
        profile_refuses = True
    assert profile_refuses == (problem is not None), "the profile kvtune render loads judges the same"
    if problem is None:
        assert arg(engine_container(manifests({"engine": engine})), "--model") == model
        return
    message = render_error({"engine": engine})
    geometry = kv_math.KNOWN_MODELS[model]
    if problem.startswith("tensor_parallel_size"):
        assert f"engine.tensorParallelSize {tp}: vLLM cannot split {model}'s" in message, message
        assert (
            f"{geometry.num_attention_heads} attention heads and {geometry.num_kv_heads} KV heads" in message
        )
        allowed = re.search(r"use one of ([\d, ]+)$", problem)
        assert allowed and f"use one of {allowed.group(1)}" in message, (problem, message)
    else:
        assert f"engine.pipelineParallelSize {pp} exceeds {model}'s {geometry.num_layers} layers" in message


def test_tp_3_for_a_model_of_32_heads_is_refused_in_an_item_too() -> None:
    message = render_error(
        {"engines": [{"name": "a", "engine": {"model": LLAMA_8B, "tensorParallelSize": 3}}]}
    )
    assert "engines[a].engine.tensorParallelSize 3: vLLM cannot split" in message
    assert (
        "32 attention heads and 8 KV heads 3 ways" in message and "use one of 1, 2, 4, 8, 16, 32" in message
    )


# ---- resources the API server would refuse --------------------------------------------------------------

# Byte multiples of the units a quantity may carry (Kubernetes' binary and decimal suffixes).
UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
# Llama 3.1 8B on one GPU: 16,060,522,496 bytes of weights -> 15 GiB, + 4 GiB + 2 GiB per GPU = 21 GiB;
# 2 CPUs per GPU + 2 = 4.
SIZED_8B = {"memory": 21 * GIB, "cpu": 4}


def quantity(byte_count: int, unit: str) -> str:
    """BYTE_COUNT written in UNIT, rounded down to a whole number of it."""
    return f"{byte_count // UNITS[unit]}{unit}"


def in_bytes(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([A-Za-z]*)", text).groups()  # type: ignore[union-attr]
    return int(number) * UNITS[unit]


@RENDERS
@given(memory_gib=st.integers(1, 40), unit=st.sampled_from(sorted(UNITS)), cpu=st.integers(1, 8))
def test_a_limit_below_the_request_the_chart_sizes_is_refused_with_both(
    memory_gib: int, unit: str, cpu: int
) -> None:
    limit = quantity(memory_gib * GIB, unit)
    values = {"engine": {"model": LLAMA_8B}, "resources": {"limits": {"memory": limit, "cpu": str(cpu)}}}
    below = {"cpu": cpu < SIZED_8B["cpu"], "memory": in_bytes(limit) < SIZED_8B["memory"]}
    if not any(below.values()):
        resources = engine_container(manifests(values))["resources"]
        assert resources["requests"] == {"cpu": "4", "memory": "21Gi"}
        assert resources["limits"] == {"memory": limit, "cpu": str(cpu), "nvidia.com/gpu": 1}
        return
    message = render_error(values)
    resource = "cpu" if below["cpu"] else "memory"
    sized, shown = ("4", str(cpu)) if resource == "cpu" else ("21Gi", limit)
    expected = (
        f"resources.limits.{resource} {shown} is below the {resource} request the chart sizes from the "
    )
    assert expected in message, message
    assert f"raise the limit to at least {sized}, or give resources.requests yourself" in message


@RENDERS
@given(
    request=st.integers(1, 200 * GIB),
    limit=st.integers(1, 200 * GIB),
    units=st.tuples(st.sampled_from(sorted(UNITS)), st.sampled_from(sorted(UNITS))),
)
def test_a_given_request_above_its_limit_is_refused(request: int, limit: int, units: tuple[str, str]) -> None:
    wanted, most = quantity(request, units[0]), quantity(limit, units[1])
    if in_bytes(wanted) == 0 or in_bytes(most) == 0:
        return
    values = {"resources": {"requests": {"memory": wanted}, "limits": {"memory": most}}}
    if in_bytes(wanted) <= in_bytes(most):
        assert engine_container(manifests(values))["resources"]["requests"] == {"memory": wanted}
        return
    message = render_error(values)
    assert f"resources.requests.memory {wanted} is above resources.limits.memory {most}" in message, message


@RENDERS
@given(tp=st.sampled_from([1, 2, 4, 8]), request=st.integers(0, 8))
def test_a_gpu_request_must_equal_the_gpu_limit_of_the_engine_s_ranks(tp: int, request: int) -> None:
    values = {
        "engine": {"model": LLAMA_70B, "tensorParallelSize": tp},
        "resources": {"requests": {"nvidia.com/gpu": request, "cpu": "8", "memory": "160Gi"}},
    }
    if request == tp:
        resources = engine_container(manifests(values))["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == tp
        return
    message = render_error(values)
    assert f"resources.requests.nvidia.com/gpu is {request}, but the engine runs {tp} rank(s)" in message
    assert f"Kubernetes wants a GPU request equal to its limit ({tp})" in message, message


def test_resources_take_kubernetes_keys_and_quantities_only() -> None:
    assert "/resources" in render_error({"resources": {"request": {"memory": "8Gi"}}})
    assert "/resources/limits/memory" in render_error({"resources": {"limits": {"memory": "8 GiB"}}})
    assert "/locust/resources/limits/cpu" in render_error(
        {"locust": {"resources": {"limits": {"cpu": "-1"}}}}
    )


# ---- the download cache against the weights it holds ----------------------------------------------------


@RENDERS
@given(model=st.sampled_from(sorted(kv_math.KNOWN_MODELS)), size_gib=st.integers(1, 300))
def test_a_cache_smaller_than_the_weights_downloaded_into_it_is_refused(model: str, size_gib: int) -> None:
    weights = kv_math.KNOWN_MODELS[model].weight_bytes
    least_gib = math.ceil((weights + 2 * GIB) / GIB)
    tp = 4 if model == LLAMA_70B else 1
    values = {
        "engine": {"model": model, "tensorParallelSize": tp},
        "cache": {"enabled": True, "size": f"{size_gib}Gi"},
    }
    if size_gib >= least_gib:
        claim = one(manifests(values), "PersistentVolumeClaim")
        assert claim["spec"]["resources"]["requests"]["storage"] == f"{size_gib}Gi"
        return
    message = render_error(values)
    expected = f"cache.size {size_gib}Gi is {size_gib * GIB} bytes, but {model}'s weights are {weights} bytes"
    assert expected in message, message
    assert f"set cache.size to at least {least_gib}Gi" in message


def test_the_70b_model_s_weights_need_134_gib_of_cache() -> None:
    # 141,107,412,992 bytes of weights + 2 GiB = 143,254,896,640 bytes = 133.4 GiB -> 134 GiB.
    values = {
        "engine": {"model": LLAMA_70B, "tensorParallelSize": 4},
        "cache": {"enabled": True, "size": "100Gi"},
    }
    message = render_error(values)
    assert "(131.4 GiB)" in message and "at least 134Gi" in message, message
    for elsewhere in (
        {"cache": {"existingClaim": "models-cache"}},  # the user's claim: its size is not the chart's
        {"modelSource": {"source": "pvc", "pvc": {"claimName": "weights"}}},  # the weights are not in it
    ):
        manifests(values, elsewhere)


# ---- values that become Kubernetes names ----------------------------------------------------------------

# Kubernetes' own definitions (k8s.io/apimachinery/pkg/util/validation): a label is at most 63 lower-case
# alphanumerics or '-', starting and ending alphanumeric; a subdomain is labels joined by '.', at most 253; a
# Service's name (RFC 1035) starts with a letter.
_K8S_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
KUBERNETES_ACCEPTS: dict[str, Any] = {
    "subdomain": lambda n: len(n) <= 253 and re.fullmatch(rf"{_K8S_LABEL}(?:\.{_K8S_LABEL})*", n) is not None,
    "label": lambda n: len(n) <= 63 and re.fullmatch(_K8S_LABEL, n) is not None,
    "service": lambda n: len(n) <= 63 and re.fullmatch(r"[a-z](?:[-a-z0-9]*[a-z0-9])?", n) is not None,
    # An extended resource: DOMAIN/NAME, the domain a subdomain, the name a qualified name's (at most 63
    # letters of either case, digits, '-', '_' or '.', alphanumeric at both ends).
    "resource": lambda n: (
        n.count("/") == 1
        and KUBERNETES_ACCEPTS["subdomain"](n.split("/")[0])
        and re.fullmatch(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", n.split("/")[1]) is not None
    ),
}
# Each value that becomes a name: where it sits in values (a function of the name), its schema path, its rule.
NAME_FIELDS: dict[str, tuple[Any, str, str]] = {
    "runtimeClassName": (lambda n: {"runtimeClassName": n}, "/runtimeClassName", "subdomain"),
    "priorityClassName": (lambda n: {"priorityClassName": n}, "/priorityClassName", "subdomain"),
    "serviceAccountName": (lambda n: {"serviceAccountName": n}, "/serviceAccountName", "subdomain"),
    "pullSecrets": (lambda n: {"images": {"pullSecrets": [n]}}, "/images/pullSecrets/0", "subdomain"),
    "apiKeySecret": (
        lambda n: {"engine": {"apiKeySecret": {"name": n, "key": "k"}}},
        "/engine/apiKeySecret/name",
        "subdomain",
    ),
    "secretEnvSecret": (lambda n: {"engine": {"secretEnvSecret": n}}, "/engine/secretEnvSecret", "subdomain"),
    "hubTokenSecret": (
        lambda n: {"modelSource": {"hubTokenSecret": {"name": n}}},
        "/modelSource/hubTokenSecret/name",
        "subdomain",
    ),
    "claimName": (
        lambda n: {"modelSource": {"pvc": {"claimName": n}}},
        "/modelSource/pvc/claimName",
        "subdomain",
    ),
    "credentialsSecret": (
        lambda n: {"modelSource": {"objectStorage": {"credentialsSecret": n}}},
        "/modelSource/objectStorage/credentialsSecret",
        "subdomain",
    ),
    "existingClaim": (lambda n: {"cache": {"existingClaim": n}}, "/cache/existingClaim", "subdomain"),
    "storageClassName": (
        lambda n: {"cache": {"storageClassName": n}},
        "/cache/storageClassName",
        "subdomain",
    ),
    "endpointPicker": (
        lambda n: {"inferencePool": {"endpointPicker": {"serviceName": n}}},
        "/inferencePool/endpointPicker/serviceName",
        "service",
    ),
    "gatewayName": (
        lambda n: {"inferencePool": {"httpRoute": {"gatewayName": n}}},
        "/inferencePool/httpRoute/gatewayName",
        "subdomain",
    ),
    "gatewayNamespace": (
        lambda n: {"inferencePool": {"httpRoute": {"gatewayNamespace": n}}},
        "/inferencePool/httpRoute/gatewayNamespace",
        "label",
    ),
    "sweepSecret": (
        lambda n: {"sweep": {"storage": {"secretName": n}}},
        "/sweep/storage/secretName",
        "subdomain",
    ),
    "resultsClaim": (lambda n: {"sweep": {"resultsClaim": n}}, "/sweep/resultsClaim", "subdomain"),
    "extraVolume": (
        lambda n: {"extraVolumes": [{"name": n, "emptyDir": {}}]},
        "/extraVolumes/0/name",
        "label",
    ),
    "initContainer": (
        lambda n: {"initContainers": [{"name": n, "image": "busybox:1.37"}]},
        "/initContainers/0/name",
        "label",
    ),
    "gpuResourceName": (lambda n: {"gpuResourceName": n}, "/gpuResourceName", "resource"),
    "itemRuntimeClass": (
        lambda n: {"engines": [{"name": "a", "runtimeClassName": n}]},
        "/engines/0/runtimeClassName",
        "subdomain",
    ),
}
NAMES = st.one_of(
    st.from_regex(r"[a-z0-9]([-a-z0-9]{0,12}[a-z0-9])?(\.[a-z0-9]{1,6}){0,2}", fullmatch=True),
    st.text(alphabet="abZ09-._ /:", min_size=1, max_size=16),  # capitals, '_', spaces, edges of '-' and '.'
    st.sampled_from(
        ["NVIDIA", "nvidia_gpu", "-gpu", "gpu-", "a..b", "9lives", "x" * 63, "x" * 64, "a." * 127]
    ),
    st.from_regex(r"[a-z0-9]{1,6}(\.[a-z]{2,4})?/[A-Za-z0-9][-A-Za-z0-9_.]{0,8}", fullmatch=True),
    st.sampled_from(["nvidia.com/gpu", "nvidia.com/mig-3g.40gb", "NVIDIA.com/gpu", "gpu", "a/b/c", "x/-y"]),
)


@RENDERS
@given(field=st.sampled_from(sorted(NAME_FIELDS)), name=NAMES)
def test_every_value_that_becomes_a_name_is_refused_unless_kubernetes_accepts_it(
    field: str, name: str
) -> None:
    place, path, rule = NAME_FIELDS[field]
    if KUBERNETES_ACCEPTS[rule](name):
        manifests(place(name))
    else:
        message = render_error(place(name))
        assert f"at '{path}'" in message, message


@settings(RENDERS, max_examples=400)
@given(field=st.sampled_from(sorted(NAME_FIELDS)), name=NAMES)
def test_the_values_model_behind_the_schema_holds_kubernetes_name_rules(field: str, name: str) -> None:
    place, path, rule = NAME_FIELDS[field]
    values = merged(DEFAULT_VALUES, place(name))
    try:
        ChartValues.model_validate(values)
        accepted = True
    except ValidationError as exc:
        accepted = False
        where = [".".join(str(part) for part in error["loc"]) for error in exc.errors()]
        assert where == [path.strip("/").replace("/", ".")], (where, path)
    assert accepted == KUBERNETES_ACCEPTS[rule](name), (field, name)


def test_an_upper_case_runtime_class_is_refused_at_its_path_and_the_lower_case_one_lands_in_the_pod() -> None:
    assert "at '/runtimeClassName': 'NVIDIA' does not match pattern" in render_error(
        {"runtimeClassName": "NVIDIA"}
    )
    assert (
        deployment(manifests({"runtimeClassName": "nvidia"}))["spec"]["template"]["spec"]["runtimeClassName"]
        == "nvidia"
    )


# ---- mounts and volumes ---------------------------------------------------------------------------------

VOLUME_NAMES = ["cache", "shm", "models", "certs", "data", "scratch"]


@RENDERS
@given(
    extra=st.lists(st.sampled_from(VOLUME_NAMES), max_size=3),
    mounts=st.lists(st.sampled_from(VOLUME_NAMES), max_size=3, unique=True),
)
def test_every_mount_names_a_volume_of_the_pod(extra: list[str], mounts: list[str]) -> None:
    chart_volumes = ["cache", "shm"]  # the defaults: hub source, no warm-up
    values = {
        "extraVolumes": [{"name": name, "emptyDir": {}} for name in extra],
        "extraVolumeMounts": [{"name": name, "mountPath": f"/mnt/{name}"} for name in mounts],
    }
    seen = list(chart_volumes)
    for index, name in enumerate(extra):
        if name in seen:
            message = render_error(values)
            assert (
                f'extraVolumes[{index}] is named "{name}", a name the pod\'s volumes already use' in message
            )
            return
        seen.append(name)
    for index, name in enumerate(mounts):
        if name not in seen:
            message = render_error(values)
            assert (
                f'extraVolumeMounts[{index}] mounts volume "{name}", which the pod does not have' in message
            )
            assert f"(its volumes: {', '.join(seen)})" in message, message
            return
    spec = deployment(manifests(values))["spec"]["template"]["spec"]
    assert [v["name"] for v in spec["volumes"]] == seen


def test_a_mount_over_a_chart_mount_and_an_init_container_s_unknown_volume_are_refused() -> None:
    message = render_error({"extraVolumes": [{"name": "x", "emptyDir": {}}],
                            "extraVolumeMounts": [{"name": "x", "mountPath": "/cache"}]})  # fmt: skip
    assert 'extraVolumeMounts[0] mounts at /cache, where volume "cache" is mounted already' in message
    init = {"name": "fetch", "image": "busybox:1.37", "volumeMounts": [{"name": "w", "mountPath": "/w"}]}
    message = render_error({"initContainers": [init]})
    assert 'initContainers[0] (fetch) mounts volume "w", which the pod does not have' in message
    assert "/extraVolumeMounts/0" in render_error({"extraVolumeMounts": [{"name": "x"}]}), (
        "mountPath required"
    )


# ---- object storage: the credentials of the URL's store -------------------------------------------------


def object_storage_values(url: str, **storage: str) -> dict[str, Any]:
    return {
        "engine": {"model": url, "loadFormat": "runai_streamer"},
        "modelSource": {
            "source": "objectStorage",
            "objectStorage": {"credentialsSecret": "store-creds"} | storage,
        },
    }


@pytest.mark.parametrize("scheme", sorted(object_storage.STORES))
def test_object_storage_credentials_follow_the_url_s_scheme(scheme: str) -> None:
    store = object_storage.STORES[scheme]
    docs = manifests(object_storage_values(f"{scheme}://models/llama-3.1-8b"))
    valid(docs)
    container = vllm(docs)
    env = {e["name"]: e for e in container["env"]}
    others = {
        name
        for other in object_storage.STORES.values()
        if other is not store
        for name in (*other.env_keys, other.file_env, other.endpoint_env)
        if name
    }
    assert not others & set(env), f"{scheme}:// gets another store's variables"
    for key in store.env_keys:
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "store-creds", "key": key}
    volumes = {v["name"]: v for v in deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    if store.file_key and store.file_env:
        path = env[store.file_env]["value"]
        mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {
            "secretName": "store-creds",
            "items": [{"key": store.file_key, "path": path.rsplit("/", 1)[1]}],
        }
    else:
        assert "object-storage-credentials" not in volumes


def test_a_gs_model_gets_no_aws_keys_and_no_s3_endpoint() -> None:
    env = {e["name"] for e in vllm(manifests(object_storage_values("gs://models/llama")))["env"]}
    assert "GOOGLE_APPLICATION_CREDENTIALS" in env and not {n for n in env if n.startswith("AWS_")}
    message = render_error(object_storage_values("gs://models/llama", endpointUrl="http://minio:9000"))
    assert "modelSource.objectStorage.endpointUrl is set, but Google Cloud Storage" in message, message
    message = render_error(object_storage_values("az://models/llama"))
    assert (
        'engine.model "az://models/llama": modelSource.source objectStorage loads gs:// or s3:// URLs'
        in message
    )


# ---- environment variables the chart sets ---------------------------------------------------------------

# Values under which the chart sets every variable it has: an API key, a hub token, the CPU build's
# variables, each store's credentials.
CHART_ENV_SETUPS: list[dict[str, Any]] = [
    {"engine": {"apiKeySecret": {"name": "key", "key": "api-key"}},
     "modelSource": {"hubTokenSecret": {"name": "hf", "key": "HF_TOKEN"}}},
    {"engine": {"device": "cpu", "model": "smollm2-135m", "kvCacheMemoryBytes": GIB, "blockSize": 128,
                "cpuThreadsBind": "auto", "cpuReservedCores": 1}},
    *[object_storage_values(f"{scheme}://b/m", endpointUrl="http://store:9000" if store.endpoint_env else "")
      for scheme, store in object_storage.STORES.items()],
]  # fmt: skip


def _chart_env(setup: dict[str, Any]) -> list[str]:
    """The variables the chart sets under SETUP, read from its render (CPU_COMPILE_ENV's are defaults that
    engine.env may replace)."""
    return [e["name"] for e in vllm(manifests(setup))["env"] if e["name"] not in CPU_COMPILE_ENV]


@pytest.mark.parametrize(
    ("setup", "name"),
    [(setup, name) for setup in CHART_ENV_SETUPS for name in _chart_env(setup)],
)
def test_an_env_name_the_chart_sets_is_refused_listing_the_chart_s_names(
    setup: dict[str, Any], name: str
) -> None:
    planted = "kvtune-planted-value-7f3a"
    message = render_error(setup, {"engine": {"env": {name: planted}}})
    assert f"engine.env.{name}: the chart sets {name} itself" in message, message
    assert f"(the chart sets: {', '.join(_chart_env(setup))})" in message
    assert planted not in message, "a value is never shown (it may be a credential)"
    message = render_error(setup, {"engine": {"secretEnv": [name], "secretEnvSecret": "env"}})
    assert f"engine.secretEnv lists {name}, which the chart sets itself" in message, message


def test_the_cpu_build_s_start_up_variables_may_be_replaced_and_other_names_pass() -> None:
    cpu = CHART_ENV_SETUPS[1]
    (name,) = CPU_COMPILE_ENV
    env = {
        e["name"]: e.get("value")
        for e in vllm(manifests(cpu, {"engine": {"env": {name: "1", "X_A": "b"}}}))["env"]
    }
    assert env[name] == "1" and env["X_A"] == "b"
    message = render_error({"engine": {"env": {"X_A": "b"}, "secretEnv": ["X_A"], "secretEnvSecret": "env"}})
    assert "engine.secretEnv lists X_A, which engine.env sets too" in message


# ---- removed keys and the chart's version ---------------------------------------------------------------


@pytest.mark.parametrize("key", REMOVED_KEYS, ids=[key.path for key in REMOVED_KEYS])
def test_a_removed_key_is_refused_with_what_replaces_it(key: Any) -> None:
    message = render_error(at_path(key.path, 1))
    assert f"{key.path} was removed in chart {key.removed_in}: {key.replacement}" in message, message
    message = render_error({"engines": [{"name": "a", **at_path(key.path, 1)}]})
    assert f"engines[a].{key.path} was removed in chart {key.removed_in}" in message, message


def test_removed_keys_are_not_current_keys_and_the_changelog_names_each() -> None:
    changelog = (CHART / "CHANGELOG.md").read_text(encoding="utf-8")
    for key in REMOVED_KEYS:
        model: Any = ChartValues  # the section holding the key, walked down by alias
        *parents, last = key.path.split(".")
        for part in parents:
            model = next(info.annotation for info in model.model_fields.values() if info.alias == part)
        assert last not in {info.alias for info in model.model_fields.values()}, key.path
        section = changelog.split(f"## [{key.removed_in}]")[1].split("\n## [")[0]
        assert f"`{key.path}`" in section.split("### Removed")[1].split("###")[0], key.path


def test_the_changelog_s_top_entry_is_the_chart_s_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    semver = r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?"
    assert re.fullmatch(semver, chart["version"]), chart["version"]
    changelog = (CHART / "CHANGELOG.md").read_text(encoding="utf-8")
    entries = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", changelog, re.MULTILINE)
    assert entries, "no `## [VERSION] - DATE` entries"
    assert entries[0][0] == chart["version"], (
        f"CHANGELOG's top entry {entries[0][0]}, Chart.yaml {chart['version']}"
    )
    versions = [tuple(int(part) for part in version.split(".")) for version, _ in entries]
    assert versions == sorted(versions, reverse=True) and all(date for _, date in entries), entries
