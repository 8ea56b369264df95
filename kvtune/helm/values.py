"""The Helm chart's values as a typed model, built from the engine profile's own fields.

The chart's `engine` section is the profile under camelCase names: each field keeps the profile's type,
bounds and description, so `values.schema.json` (generated from this module), `kvtune render --as
helm-values` and the sweep's `values.yaml` cannot drift from what `kvtune up` accepts. What only the
chart knows (images, model source, probes, Service, monitoring, scale-out, in-cluster Locust) is modelled
here too, with the same strictness: an unknown key is an error naming it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from kvtune import vllm_parser
from kvtune.model_store import EMBEDDED_MODELS
from kvtune.profile import EngineProfile, chart_fields, chart_omissions, refused_settings
from kvtune.slo import DEFAULT_TTFT_P99_SLO_S

# Profile fields the chart's `engine` section carries, in the profile's order, and those it does not with what
# stands for them in a pod: each field's FieldFacts says which (kvtune.profile.model).
CHART_ENGINE_FIELDS: tuple[str, ...] = chart_fields(EngineProfile)
CHART_OMITTED_FIELDS: dict[str, str] = chart_omissions(EngineProfile)

# The profile's defaults that depend on the host running kvtune have fixed chart defaults instead.
_CHART_DEFAULTS: dict[str, Any] = {"device": "cuda"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


def _chart_field(name: str) -> tuple[Any, Any]:
    original = EngineProfile.model_fields[name]
    if name == "kv_cache_memory_bytes":  # the chart passes the number to vLLM as it is: bytes only
        return int | None, Field(
            None, gt=0, alias=to_camel(name), description="Explicit KV cache size in bytes."
        )
    overrides: dict[str, Any] = {"alias": to_camel(name)}
    if name in _CHART_DEFAULTS:
        overrides |= {"default_factory": None, "default": _CHART_DEFAULTS[name]}
    return original.annotation, FieldInfo.merge_field_infos(original, **overrides)


_engine_fields: dict[str, Any] = {name: _chart_field(name) for name in CHART_ENGINE_FIELDS}


class SecretKeyRef(_Strict):
    """A key of a Kubernetes Secret the user creates (the chart never holds a credential's value)."""

    name: str = Field("", description="The Secret's name; empty = not used.")
    key: str = Field(description="The key inside the Secret.")


class EngineSecrets(_Strict):
    api_key_secret: SecretKeyRef = Field(
        default_factory=lambda: SecretKeyRef(key="api-key"),
        description="The API key clients must send (vLLM reads it as VLLM_API_KEY); empty name = no key.",
    )
    secret_env_secret: str = Field(
        "",
        description="The Secret holding a key for each name in secretEnv (e.g. HF_TOKEN); required when "
        "secretEnv is not empty.",
    )


ChartEngineBase = create_model(
    "ChartEngineBase",
    __config__=ConfigDict(extra="forbid", populate_by_name=True),
    __doc__="The engine profile's settings, as the chart's engine section.",
    **_engine_fields,
)


class ChartEngine(ChartEngineBase, EngineSecrets):
    """The engine: the profile's settings plus where its credentials come from."""

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra=lambda schema: _engine_rules(schema),
    )


def _engine_rules(schema: dict[str, Any]) -> None:
    """Cross-field rules of the profile that JSON Schema can state, each failing at the value's own path.

    (The profile's validators say the same in Python; a test feeds both the same bad values.)"""
    schema["allOf"] = [
        {  # one KV budget: a fraction of memory or an explicit size
            "if": {
                "properties": {"gpuMemoryUtilization": {"type": "number"}},
                "required": ["gpuMemoryUtilization"],
            },
            "then": {"properties": {"kvCacheMemoryBytes": {"type": "null"}}},
        },
        {  # vLLM's CPU attention needs blocks in multiples of 32
            "if": {"properties": {"device": {"const": "cpu"}}},
            "then": {"properties": {"blockSize": {"type": ["integer", "null"], "multipleOf": 32}}},
        },
        {  # only vLLM's CPU build reads the thread placement
            "if": {"properties": {"device": {"const": "cuda"}}, "required": ["device"]},
            "then": {
                "properties": {"cpuThreadsBind": {"type": "null"}, "cpuReservedCores": {"type": "null"}}
            },
        },
    ]


class Image(_Strict):
    repository: str = Field(description="Image repository.")
    tag: str = Field(description="Image tag; pin it (a moving tag changes the engine under a release).")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent")


class Images(_Strict):
    cuda: Image = Field(
        default_factory=lambda: Image(repository="vllm/vllm-openai", tag="v0.33.0"),
        description="vLLM's OpenAI server image for engine.device cuda.",
    )
    cpu: Image = Field(
        default_factory=lambda: Image(
            repository="public.ecr.aws/q9t5s3a7/vllm-cpu-release-repo", tag="v0.32.0"
        ),
        description="vLLM's CPU image for engine.device cpu.",
    )
    kvtune: Image = Field(
        default_factory=lambda: Image(repository="ghcr.io/kvtune/kvtune", tag="0.1.0"),
        description="kvtune's image (deploy/Dockerfile): embedded models and the Locust files.",
    )
    pull_secrets: list[str] = Field(default_factory=list, description="imagePullSecrets names.")


class ModelPvc(_Strict):
    claim_name: str = Field("", description="A PersistentVolumeClaim holding the weights.")
    sub_path: str = Field("", description="The model's folder inside the claim; engine.model names it.")


class ModelSource(_Strict):
    source: Literal["hub", "pvc", "embedded"] = Field(
        "hub",
        description="hub: engine.model is a Hugging Face id, downloaded into the cache volume; pvc: the "
        "weights are on modelPvc; embedded: a model kvtune's image carries (e.g. smollm2-135m), copied in "
        "by an init container.",
    )
    hub_token_secret: SecretKeyRef = Field(
        default_factory=lambda: SecretKeyRef(key="HF_TOKEN"),
        description="A Hugging Face token for gated models (source hub); empty name = none.",
    )
    pvc: ModelPvc = Field(default_factory=ModelPvc)


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]


def _read_write_once() -> list[AccessMode]:
    return ["ReadWriteOnce"]


class Persistence(_Strict):
    enabled: bool = Field(False, description="A PVC for the download and compile caches (else emptyDir).")
    existing_claim: str = Field("", description="Use this claim instead of creating one.")
    size: str = Field("50Gi", pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
    storage_class_name: str = Field("", description="Empty = the cluster's default class.")
    access_modes: list[AccessMode] = Field(default_factory=_read_write_once)


class Probe(_Strict):
    period_seconds: int = Field(10, ge=1)
    timeout_seconds: int = Field(5, ge=1)
    failure_threshold: int = Field(3, ge=1)


class Probes(_Strict):
    startup_period_seconds: int = Field(
        10,
        ge=1,
        description="The startup probe polls /health this often until engine.readyTimeoutS has passed: "
        "slow model loads get their time without a long initial delay on every restart.",
    )
    readiness: Probe = Field(default_factory=lambda: Probe(period_seconds=5, timeout_seconds=5))
    liveness: Probe = Field(
        default_factory=lambda: Probe(period_seconds=15, timeout_seconds=10, failure_threshold=4)
    )


class Service(_Strict):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field("ClusterIP")
    port: int = Field(8000, ge=1, le=65535, description="The Service's port (the pod listens on 8000).")
    annotations: dict[str, str] = Field(default_factory=dict)


class ServiceMonitor(_Strict):
    enabled: bool = Field(False, description="A prometheus-operator ServiceMonitor scraping /metrics.")
    interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels your Prometheus selects on.")


class PodMonitor(_Strict):
    enabled: bool = Field(False, description="A PodMonitor instead (no Service needed); not with both.")
    interval: str = Field("15s", pattern=r"^[0-9]+(ms|s|m|h)$")
    labels: dict[str, str] = Field(default_factory=dict)


class PrometheusRule(_Strict):
    enabled: bool = Field(False, description="kvtune's alert rules as a PrometheusRule.")
    ttft_p99_slo_seconds: float = Field(
        DEFAULT_TTFT_P99_SLO_S,
        gt=0,
        allow_inf_nan=False,
        description="The P99 TTFT SLO of KvtuneTtftP99AboveSlo (a sweep's values.yaml sets its own).",
    )
    labels: dict[str, str] = Field(default_factory=dict)


class Dashboards(_Strict):
    enabled: bool = Field(False, description="kvtune's Grafana dashboards as ConfigMaps.")
    labels: dict[str, str] = Field(
        default_factory=lambda: {"grafana_dashboard": "1"},
        description="The label Grafana's dashboard sidecar watches for (its default).",
    )
    annotations: dict[str, str] = Field(
        default_factory=dict, description="e.g. grafana_folder: kvtune, when the sidecar uses folders."
    )


class Monitoring(_Strict):
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor)
    pod_monitor: PodMonitor = Field(default_factory=PodMonitor)
    prometheus_rule: PrometheusRule = Field(default_factory=PrometheusRule)
    dashboards: Dashboards = Field(default_factory=Dashboards)


class Hpa(_Strict):
    enabled: bool = Field(False, description="An HPA on the pods metric below (needs a metrics adapter).")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(4, ge=1)
    metric_name: str = Field(
        "vllm_num_requests_waiting",
        description="vllm:num_requests_waiting as your custom-metrics adapter names it for the HPA.",
    )
    target_average_waiting: int = Field(4, ge=1, description="Waiting requests per pod to scale at.")


class Keda(_Strict):
    enabled: bool = Field(False, description="A KEDA ScaledObject instead of an HPA; not with both.")
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    prometheus_address: str = Field(
        "http://prometheus-operated.monitoring.svc:9090", description="The Prometheus KEDA queries."
    )
    threshold_waiting: int = Field(4, ge=1, description="Waiting requests per replica to scale at.")
    polling_interval_seconds: int = Field(15, ge=1)
    cooldown_period_seconds: int = Field(300, ge=0)


class Autoscaling(_Strict):
    hpa: Hpa = Field(default_factory=Hpa)
    keda: Keda = Field(default_factory=Keda)


class EndpointPicker(_Strict):
    service_name: str = Field(
        "", description="The endpoint picker's Service (llm-d's inference scheduler, its own chart)."
    )
    port: int = Field(9002, ge=1, le=65535, description="Its ext-proc gRPC port.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose")


class HttpRoute(_Strict):
    enabled: bool = Field(False, description="An HTTPRoute sending the Gateway's traffic to the pool.")
    gateway_name: str = Field("", description="The Gateway (an inference-capable one) to attach to.")
    gateway_namespace: str = Field("", description="Empty = the release's namespace.")
    path_prefix: str = Field("/", description="Paths routed to the pool.")
    request_timeout: str = Field("300s", pattern=r"^[0-9]+(ms|s|m|h)$")


class KvEvents(_Strict):
    enabled: bool = Field(
        False,
        description="vLLM publishes KV-cache events over ZMQ (--kv-events-config), for a precise "
        "prefix-cache scorer.",
    )
    port: int = Field(5557, ge=1, le=65535, description="The port vLLM binds when endpoint is empty.")
    endpoint: str = Field(
        "",
        description="Empty: vLLM binds tcp://*:port in the pod and the scheduler subscribes to each pod; "
        "else the scheduler's ZMQ address vLLM connects to (e.g. tcp://NAME-epp.NS.svc:5557).",
    )


class InferencePool(_Strict):
    enabled: bool = Field(
        False, description="An InferencePool (inference.networking.k8s.io/v1) over the engine pods."
    )
    endpoint_picker: EndpointPicker = Field(default_factory=EndpointPicker)
    http_route: HttpRoute = Field(default_factory=HttpRoute)


class Locust(_Strict):
    enabled: bool = Field(False, description="Locust master (web UI) and workers against the engine Service.")
    workload: Literal["shared_prefix", "multi_turn", "long_doc_qa", "step_shape"] = Field(
        "shared_prefix", description="Which of kvtune's Locust files to run (loadtests/)."
    )
    workers: int = Field(1, ge=0)
    extra_args: list[str] = Field(
        default_factory=list, description="Further locust options, e.g. --system-tokens 800."
    )
    web_port: int = Field(8089, ge=1, le=65535)
    resources: dict[str, Any] = Field(default_factory=dict)


class ReleaseTests(_Strict):
    """`helm test RELEASE`: pods that check the release from inside the cluster (templates/tests/)."""

    enabled: bool = Field(
        True,
        description="The test pods (hooks: `helm test` creates them), and the ServiceAccount and Role two of "
        "them read the release's own objects with (get by name, list pods; nothing written).",
    )
    image: Literal["engine", "kvtune"] = Field(
        "engine",
        description="The image whose python3 runs the checks: the engine's (on its nodes already) or "
        "kvtune's.",
    )
    rollout_timeout_seconds: int = Field(
        1800,
        ge=1,
        description="How long the rollout pod waits for the Deployments (model loads are slow); give "
        "`helm test --timeout` at least as long.",
    )
    request_timeout_seconds: int = Field(120, ge=1, description="Seconds each HTTP request may take.")


class ChartValues(_Strict):
    """Everything `helm install -f values.yaml` takes (values.schema.json is this model's schema)."""

    images: Images = Field(default_factory=Images)
    engine: ChartEngine = Field(
        description="The engine profile, as kvtune render --as helm-values writes it."
    )
    model_source: ModelSource = Field(default_factory=ModelSource)
    replicas: int = Field(1, ge=0, description="Engine pods (one engine each); ignored under autoscaling.")
    gpus_per_engine: int = Field(1, ge=1, description="nvidia.com/gpu per pod for device cuda.")
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description="The engine container's resources; empty = a GPU limit for cuda, requests sized from "
        "the KV budget for cpu.",
    )
    cache: Persistence = Field(default_factory=Persistence)
    shm_size: str = Field("8Gi", description="Size of /dev/shm (vLLM's worker processes share tensors).")
    probes: Probes = Field(default_factory=Probes)
    service: Service = Field(default_factory=Service)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    pod_security_context: dict[str, Any] = Field(
        default_factory=lambda: {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
        },
        description="vLLM's images run as any user once HOME and the caches point at writable volumes.",
    )
    security_context: dict[str, Any] = Field(
        default_factory=lambda: {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    )
    termination_grace_period_seconds: int | None = Field(
        None, ge=0, description="Empty = engine.shutdownTimeout plus 10 s, so requests in flight finish."
    )
    kv_events: KvEvents = Field(default_factory=KvEvents)
    monitoring: Monitoring = Field(default_factory=Monitoring)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    inference_pool: InferencePool = Field(default_factory=InferencePool)
    locust: Locust = Field(default_factory=Locust)
    tests: ReleaseTests = Field(default_factory=ReleaseTests)


def profile_fields_from_engine(engine: dict[str, Any]) -> dict[str, Any]:
    """The profile fields a chart `engine` section stands for (camelCase keys to the profile's names)."""
    parsed = ChartEngine.model_validate(engine)
    return {name: getattr(parsed, name) for name in CHART_ENGINE_FIELDS if getattr(parsed, name) is not None}


def profile_from_engine(engine: dict[str, Any], name: str = "engine") -> EngineProfile:
    """The engine profile a chart `engine` section deploys, checked by every rule of the profile."""
    return EngineProfile.model_validate({"name": name, **profile_fields_from_engine(engine)})


def chart_values(profile: EngineProfile, ttft_p99_slo_seconds: float | None = None) -> dict[str, Any]:
    """The values that install PROFILE with the chart, unchanged, on top of the chart's defaults.

    Every engine key is written, unset ones as null: Helm drops a default a values file sets to null, so
    the engine runs this profile and nothing left over from the chart's example defaults.
    """
    fields = profile.model_dump(mode="json", include=set(CHART_ENGINE_FIELDS))
    engine: dict[str, Any] = {to_camel(name): fields[name] for name in CHART_ENGINE_FIELDS}
    if profile.api_key_env or profile.api_key_file:
        engine["apiKeySecret"] = {"name": f"{profile.name}-api-key", "key": "api-key"}
    if profile.secret_env:
        engine["secretEnvSecret"] = f"{profile.name}-env"
    values: dict[str, Any] = {
        "engine": engine,
        "modelSource": {"source": "embedded" if profile.model in EMBEDDED_MODELS else "hub"},
    }
    if ttft_p99_slo_seconds is not None:
        values["monitoring"] = {"prometheusRule": {"ttftP99SloSeconds": ttft_p99_slo_seconds}}
    ChartValues.model_validate(_without_nulls(values) | {"engine": _without_nulls(engine)})
    return values


def chart_values_header(profile: EngineProfile) -> list[str]:
    """What a user must create before installing these values (Secrets are named, never filled in)."""
    lines = ["Helm values for the kvtune chart: helm install NAME helm/kvtune -f THIS_FILE"]
    if profile.api_key_env or profile.api_key_file:
        lines.append(
            f"API key: kubectl create secret generic {profile.name}-api-key --from-literal=api-key=KEY"
        )
    if profile.secret_env:
        literals = " ".join(f"--from-literal={name}=VALUE" for name in profile.secret_env)
        lines.append(f"secret_env: kubectl create secret generic {profile.name}-env {literals}")
    if profile.kv_cache_dtype.startswith("fp8") and profile.device == "cpu":
        lines.append("fp8 KV on vLLM's CPU image needs nodes with AVX-512 or AMX (set nodeSelector)")
    if profile.warmup:
        lines.append("warmup prefixes are sent by `kvtune up` only: the chart does not send them")
    return lines


def _without_nulls(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def values_schema() -> dict[str, Any]:
    """values.schema.json: the JSON Schema of ChartValues, self-contained (no $refs)."""
    schema = ChartValues.model_json_schema(by_alias=True)
    definitions = schema.pop("$defs", {})
    inlined = _inline(schema, definitions)
    _refuse_owned_extra_args(inlined["properties"]["engine"]["properties"]["extraArgs"])
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **_simplify(inlined)}


def _refuse_owned_extra_args(extra_args: dict[str, Any]) -> None:
    """The profile's rule on extra_args, as far as a regular expression can state it: no word vLLM's parser
    reads as a flag the chart or an engine value sets, or as one carrying a credential, in any spelling.
    (The chart cannot run vLLM's parser; the expression is generated from it, so `--por` is refused too.)"""
    parser = vllm_parser.parser()
    refused = refused_settings()
    extra_args["items"] |= {
        "description": f"A vLLM {parser.version} flag or value; not (in any spelling vLLM accepts) "
        + ", ".join(setting.name for setting in refused),
        "not": {"pattern": parser.spelling_pattern(setting.dest for setting in refused)},
    }


def _inline(node: Any, definitions: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            target = definitions[node["$ref"].removeprefix("#/$defs/")]
            rest = {key: value for key, value in node.items() if key != "$ref"}
            return _inline({**target, **rest}, definitions)
        return {key: _inline(value, definitions) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline(item, definitions) for item in node]
    return node


def _simplify(node: Any) -> Any:
    """`anyOf: [X, null]` as X admitting null, so an error names the bound that failed, not the anyOf;
    titles dropped (descriptions say more)."""
    if isinstance(node, list):
        return [_simplify(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _simplify(value) for key, value in node.items() if key != "title"}
    options = node.get("anyOf")
    if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
        (other,) = [option for option in options if option != {"type": "null"}]
        if isinstance(other.get("type"), str):
            merged = {**other, "type": [other["type"], "null"]}
            if "enum" in merged:
                merged["enum"] = [*merged["enum"], None]
            rest = {key: value for key, value in node.items() if key != "anyOf"}
            return {**merged, **rest}
    return node
