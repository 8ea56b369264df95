"""The Helm chart's values as a typed model, built from the engine profile's own fields.

The chart's `engine` section is the profile under camelCase names: each field keeps the profile's type,
bounds and description, so `values.schema.json` (generated from this module), `kvtune render --as
helm-values` and the sweep's `values.yaml` cannot drift from what `kvtune up` accepts. What only the
chart knows (images, model source, probes, Service, monitoring, scale-out, in-cluster Locust) is modelled
here too, with the same strictness: an unknown key is an error naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model, model_validator
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from kvtune import vllm_parser
from kvtune.helm import object_storage, removed_keys
from kvtune.helm.autoscaling import ceiling_problem
from kvtune.helm.k8s_types import (
    DNS1123_LABEL,
    EXTENDED_RESOURCE,
    ConfigKey,
    Dns1123Label,
    Dns1123Subdomain,
    Resources,
    label_field,
    service_name_field,
    subdomain_field,
)
from kvtune.helm.warmup_hook import MAX_READY_TIMEOUT_S, MIN_READY_TIMEOUT_S
from kvtune.model_store import EMBEDDED_MODELS
from kvtune.observability.scaling_signal import DEFAULT_SIGNAL, SIGNAL_NAMES, SIGNALS, SignalName
from kvtune.profile import EngineProfile, WarmupPrefix, chart_fields, chart_omissions, refused_settings
from kvtune.profile.argv_text import NO_VARIABLE_REFERENCE
from kvtune.slo import DEFAULT_TTFT_P99_SLO_S

# Profile fields the chart's `engine` section carries, in the profile's order, and those it does not with what
# stands for them in a pod: each field's FieldFacts says which (kvtune.profile.model).
CHART_ENGINE_FIELDS: tuple[str, ...] = chart_fields(EngineProfile)
CHART_OMITTED_FIELDS: dict[str, str] = chart_omissions(EngineProfile)

# The profile's defaults that depend on the host running kvtune have fixed chart defaults instead.
_CHART_DEFAULTS: dict[str, Any] = {"device": "cuda"}


# A chart value that reaches a container's args or env values, which Kubernetes expands `$(NAME)` in: the
# profile's rule on its own text (kvtune.profile.argv_text), so a value cannot copy a secret of the pod's.
ContainerText = Annotated[str, StringConstraints(pattern=NO_VARIABLE_REFERENCE)]

# A PromQL range as the chart writes it: a whole number above 0 and one unit (no 1m30s, no 0s, which
# Prometheus refuses in a range).
PROMETHEUS_WINDOW = r"^[1-9][0-9]*(ms|s|m|h)$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


def _chart_field(name: str) -> tuple[Any, Any]:
    original = EngineProfile.model_fields[name]
    if name == "kv_cache_memory_bytes":  # the chart passes the number to vLLM as it is: bytes only
        return int | None, Field(
            None, gt=0, alias=to_camel(name), description="Explicit KV cache size in bytes."
        )
    if name == "ready_timeout_s":  # the startup probe and the warm-up hook's alarm count whole seconds
        return float, Field(
            original.default,
            ge=MIN_READY_TIMEOUT_S,
            le=MAX_READY_TIMEOUT_S,
            alias=to_camel(name),
            description=original.description,
        )
    overrides: dict[str, Any] = {"alias": to_camel(name)}
    if name in _CHART_DEFAULTS:
        overrides |= {"default_factory": None, "default": _CHART_DEFAULTS[name]}
    return original.annotation, FieldInfo.merge_field_infos(original, **overrides)


_engine_fields: dict[str, Any] = {name: _chart_field(name) for name in CHART_ENGINE_FIELDS}


class SecretKeyRef(_Strict):
    """A key of a Kubernetes Secret the user creates (the chart never holds a credential's value)."""

    name: str = subdomain_field("The Secret's name; empty = not used")
    key: ConfigKey = Field(description="The key inside the Secret.")


class EngineSecrets(_Strict):
    api_key_secret: SecretKeyRef = Field(
        default_factory=lambda: SecretKeyRef(key="api-key"),
        description="The API key clients must send (vLLM reads it as VLLM_API_KEY); empty name = no key.",
    )
    secret_env_secret: str = subdomain_field(
        "The Secret holding a key for each name in secretEnv (e.g. HF_TOKEN); required when secretEnv is "
        "not empty"
    )


ChartEngineBase = create_model(
    "ChartEngineBase",
    __config__=ConfigDict(extra="forbid", populate_by_name=True),
    __doc__="The engine profile's settings, as the chart's engine section.",
    **_engine_fields,
)


class ChartWarmupPrefix(_Strict):
    """A warm-up prefix as the chart carries it: its text (a profile's file is read in)."""

    role: Literal["system", "raw"] = Field(
        "system", description=WarmupPrefix.model_fields["role"].description
    )
    text: str = Field(min_length=1, description="The prefix itself.")


class ChartEngine(ChartEngineBase, EngineSecrets):
    """The engine: the profile's settings plus where its credentials come from and its warm-up texts."""

    warmup: list[ChartWarmupPrefix] = Field(
        default_factory=list,
        description="Shared prefixes sent once the engine answers, by the container's postStart hook: the "
        "pod is not Ready (gets no traffic) until they are in its prefix cache.",
    )

    model_config = ConfigDict(
        extra="forbid",
        populate_by_name=True,
        json_schema_extra=lambda schema: _engine_rules(schema),
    )


def _engine_rules(schema: dict[str, Any]) -> None:
    """Cross-field rules of the profile that JSON Schema can state, each failing at the value's own path.

    (The profile's validators say the same in Python; a test feeds both the same bad values. Rules whose
    message must name two values, such as two KV budgets, are the chart's templates/checks.yaml.)"""
    schema["allOf"] = [
        {  # vLLM's CPU attention needs blocks in multiples of 32
            "if": {"properties": {"device": {"const": "cpu"}}},
            "then": {"properties": {"blockSize": {"type": ["integer", "null"], "multipleOf": 32}}},
        },
        {  # vLLM's CPU build refuses an offload tier (its KV cache is in host memory already)
            "if": {"properties": {"device": {"const": "cpu"}}},
            "then": {
                "properties": {"kvOffloadingSize": {"type": "null"}, "kvOffloadingBackend": {"type": "null"}}
            },
        },
        {  # vLLM offloads only when given a size, and ignores a backend without one
            "if": {"properties": {"kvOffloadingSize": {"type": "null"}}},
            "then": {"properties": {"kvOffloadingBackend": {"type": "null"}}},
        },
        {  # the sample share only samples what kvCacheMetrics turns on
            "if": {"properties": {"kvCacheMetrics": {"const": False}}},
            "then": {"properties": {"kvCacheMetricsSample": {"type": "null"}}},
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
    pull_secrets: list[Dns1123Subdomain] = Field(default_factory=list, description="imagePullSecrets names.")


class ModelPvc(_Strict):
    claim_name: str = subdomain_field("A PersistentVolumeClaim holding the weights")
    sub_path: ContainerText = Field(
        "", description="The model's folder inside the claim (vLLM's --model); empty = engine.model names it."
    )


class ObjectStorage(_Strict):
    credentials_secret: str = subdomain_field(object_storage.credentials_description().removesuffix("."))
    endpoint_url: ContainerText = Field("", description=object_storage.endpoint_description())


class ModelSource(_Strict):
    source: Literal["hub", "pvc", "embedded", "objectStorage"] = Field(
        "hub",
        description="hub: engine.model is a Hugging Face id (at engine.revision), downloaded into the cache "
        "volume; pvc: the weights are on modelSource.pvc; embedded: a model kvtune's image carries (e.g. "
        "smollm2-135m), copied in by an init container; objectStorage: engine.model is an "
        + " or ".join(f"{scheme}://" for scheme in object_storage.STORES)
        + " URL streamed by vLLM's Run:ai streamer (engine.loadFormat runai_streamer).",
    )
    hub_token_secret: SecretKeyRef = Field(
        default_factory=lambda: SecretKeyRef(key="HF_TOKEN"),
        description="A Hugging Face token for gated models (source hub); empty name = none.",
    )
    pvc: ModelPvc = Field(default_factory=ModelPvc)
    object_storage: ObjectStorage = Field(default_factory=ObjectStorage)


AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany", "ReadWriteOncePod"]


def _read_write_once() -> list[AccessMode]:
    return ["ReadWriteOnce"]


class Persistence(_Strict):
    enabled: bool = Field(False, description="A PVC for the download and compile caches (else emptyDir).")
    existing_claim: str = subdomain_field("Use this claim instead of creating one")
    size: str = Field(
        "50Gi",
        pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$",
        description="The claim's size. With modelSource.source hub the weights are downloaded into it: a "
        "model kvtune knows is refused a claim smaller than its weights plus 2 GiB for vLLM's compile "
        "caches.",
    )
    storage_class_name: str = subdomain_field("Empty = the cluster's default class")
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
    # The `helm test` pod that finds the dashboards gets their labels in its env (RELEASE_OBJECTS).
    labels: dict[str, ContainerText] = Field(
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
        "",
        description="autoscaling.signal's gauge as your custom-metrics adapter names it for the HPA; empty = "
        "the name prometheus-adapter's default rule gives it (':' as '_', such as "
        "vllm_num_requests_waiting). The adapter's rule decides its smoothing, not autoscaling.window.",
    )
    target: float = Field(
        4,
        gt=0,
        description="autoscaling.signal per pod to scale at (the HPA's AverageValue); at most 1 for "
        "kv_usage.",
    )


class Keda(_Strict):
    enabled: bool = Field(False, description="A KEDA ScaledObject instead of an HPA; not with both.")
    min_replicas: int = Field(
        1, ge=0, description="At least 1: the trigger reads the engines' own metrics (0 would never wake)."
    )
    max_replicas: int = Field(4, ge=1)
    prometheus_address: str = Field(
        "http://prometheus-operated.monitoring.svc:9090", description="The Prometheus KEDA queries."
    )
    threshold: float = Field(
        4,
        gt=0,
        description="autoscaling.signal per replica to scale at: KEDA asks for ceil(sum over the pods / "
        "threshold) replicas; at most 1 for kv_usage. `kvtune plan` derives it from a sweep.",
    )
    polling_interval_seconds: int = Field(15, ge=1)
    cooldown_period_seconds: int = Field(300, ge=0)


class Autoscaling(_Strict):
    signal: SignalName = Field(
        DEFAULT_SIGNAL,
        description="The engine gauge to scale on: "
        + "; ".join(f"{name}, {SIGNALS[name].meaning}" for name in SIGNAL_NAMES)
        + ". `kvtune plan` picks it from a sweep.",
    )
    window: str = Field(
        "1m",
        pattern=PROMETHEUS_WINDOW,
        description="The range each pod's gauge is averaged over (avg_over_time) before KEDA compares it: "
        "an instantaneous gauge jumps with every burst of arrivals. A Prometheus duration such as 30s or "
        "1m, longer than the scrape interval.",
    )
    hpa: Hpa = Field(default_factory=Hpa)
    keda: Keda = Field(default_factory=Keda)
    scale_down_stabilization_seconds: int = Field(
        600,
        ge=0,
        description="How long load must stay low before an engine is given back (HPA and KEDA): a new "
        "engine takes minutes to load its model.",
    )

    def ceiling_problems(self) -> list[str]:
        """An enabled scaler's threshold its signal can never reach (kv_usage above 1), each with the fix."""
        settings = [
            ("autoscaling.keda.threshold", self.keda.enabled, self.keda.threshold),
            ("autoscaling.hpa.target", self.hpa.enabled, self.hpa.target),
        ]
        found = [ceiling_problem(self.signal, name, value) for name, enabled, value in settings if enabled]
        return [problem for problem in found if problem]


class EndpointPicker(_Strict):
    service_name: str = service_name_field(
        "The endpoint picker's Service (llm-d's inference scheduler, its own chart); it serves one "
        "InferencePool, so each engine's pool needs its own"
    )
    port: int = Field(9002, ge=1, le=65535, description="Its ext-proc gRPC port.")
    failure_mode: Literal["FailOpen", "FailClose"] = Field("FailClose")


class HttpRoute(_Strict):
    enabled: bool = Field(False, description="An HTTPRoute sending the Gateway's traffic to the pool.")
    gateway_name: str = subdomain_field("The Gateway (an inference-capable one) to attach to")
    gateway_namespace: str = label_field("The Gateway's namespace; empty = the release's")
    path_prefix: str = Field("/", description="Paths routed to the pool.")
    request_timeout: str = Field("300s", pattern=r"^[0-9]+(ms|s|m|h)$")


class KvEvents(_Strict):
    enabled: bool = Field(
        False,
        description="vLLM publishes KV-cache events over ZMQ (--kv-events-config), for a precise "
        "prefix-cache scorer.",
    )
    port: int = Field(5557, ge=1, le=65535, description="The port vLLM binds when endpoint is empty.")
    endpoint: ContainerText = Field(
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
    extra_args: list[ContainerText] = Field(
        default_factory=list, description="Further locust options, e.g. --system-tokens 800."
    )
    web_port: int = Field(8089, ge=1, le=65535)
    resources: Resources = Field(default_factory=Resources)
    engine: str = Field(
        "",
        pattern=rf"^$|{DNS1123_LABEL}",
        max_length=20,
        description="The engine (a name in `engines`) Locust drives; empty = the first.",
    )
    tokenizer: ContainerText = Field(
        "",
        description="The tokenizer Locust counts tokens with; empty = the engine's own (its hub id at "
        "engine.revision, or its folder on the model volume, mounted read-only).",
    )


class SweepStorage(_Strict):
    secret_name: str = subdomain_field(
        "A Secret with the study's storage URL (a journal file path on the results volume, or "
        "postgresql://USER@HOST/DB) and, for a database, its password; the URL never appears in values"
    )
    url_key: ConfigKey = Field("url", description="The Secret's key holding the storage URL.")
    password_key: ConfigKey = Field(
        "PGPASSWORD", description="The Secret's key holding the database password (optional in the Secret)."
    )


class SweepJob(_Strict):
    """`kvtune sweep` as a Kubernetes Job: PARALLELISM pods, each one engine and one worker of one study."""

    enabled: bool = Field(False, description="A sweep Job (see the README's GPU cluster walk-through).")
    spec: dict[str, Any] = Field(
        default_factory=dict,
        description="The sweep spec, as deploy/sweeps/*.yaml (its base_profile is replaced by baseProfile).",
    )
    base_profile: dict[str, Any] = Field(
        default_factory=dict, description="The base engine profile, as deploy/profiles/*.yaml."
    )
    parallelism: int = Field(
        2, ge=1, le=64, description="Worker pods at once, each with its own engine (and GPUs)."
    )
    backoff_limit: int = Field(
        6,
        ge=0,
        description="Pods that may fail before the Job does; a lost pod's config is measured again by "
        "another (its claim is failed by the study's heartbeat).",
    )
    storage: SweepStorage = Field(default_factory=SweepStorage)
    results_claim: str = subdomain_field(
        "A ReadWriteMany PersistentVolumeClaim for the run folders (and a journal file); empty: each pod's "
        "folder is lost with it, and `kvtune sweep --collect` against the storage gives the report"
    )
    image: Image | None = Field(
        None,
        description="kvtune's image for the workers; empty = images.kvtune (for CUDA, build it on vLLM's "
        "CUDA image: deploy/Dockerfile's VLLM_IMAGE).",
    )
    resources: Resources = Field(
        default_factory=Resources,
        description="Each worker pod's resources; the GPU limit is the base profile's tensor x pipeline x "
        "data parallel size (cuda).",
    )


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


class _Named(BaseModel):
    """A piece of a pod spec passed through as written, but for its name, which must be Kubernetes'."""

    model_config = ConfigDict(extra="allow")

    name: Dns1123Label = Field(description="Its name (a DNS-1123 label).")


class PodVolume(_Named):
    """A pod volume (Kubernetes' Volume), passed through as written."""


class VolumeMount(_Named):
    """A mount in the vLLM container (Kubernetes' VolumeMount): its name is a volume of the pod's."""

    mount_path: str = Field(alias="mountPath", min_length=1, description="Where it is mounted.")


class InitContainer(_Named):
    """An init container (Kubernetes' Container), passed through as written."""


class PodDisruptionBudget(_Strict):
    enabled: bool = Field(
        False, description="A PodDisruptionBudget per engine: drains take its pods down one at a time."
    )
    max_unavailable: int = Field(1, ge=1, description="Engine pods a voluntary disruption may take at once.")


class ChartValues(_Strict):
    """Everything `helm install -f values.yaml` takes (values.schema.json is this model's schema)."""

    images: Images = Field(default_factory=Images)
    engine: ChartEngine = Field(
        description="The engine profile, as kvtune render --as helm-values writes it."
    )
    model_source: ModelSource = Field(default_factory=ModelSource)
    replicas: int = Field(1, ge=0, description="Engine pods (one engine each); ignored under autoscaling.")
    gpu_resource_name: str = Field(
        "nvidia.com/gpu",
        pattern=EXTENDED_RESOURCE,
        max_length=253 + 1 + 63,
        description="The extended resource a GPU is requested as, a domain-prefixed name (e.g. a MIG "
        "profile, nvidia.com/mig-3g.40gb); the count is the engine's tensorParallelSize x "
        "pipelineParallelSize x dataParallelSize.",
    )
    resources: Resources = Field(
        default_factory=Resources,
        description="The engine container's resources. The GPU limit (cuda) is always set from the parallel "
        "sizes (a GPU request, if given, must equal it); requests, when not given here, are sized from the "
        "model: cuda: its weights + 4 GiB + 2 GiB per GPU of memory and 2 CPUs per GPU + 2; cpu: KV budget "
        "+ weights + 2 GiB and 2 CPUs (a model kvtune does not know counts as 16 GiB of weights). A limit "
        "below its request, given or sized, is refused.",
    )
    cache: Persistence = Field(default_factory=Persistence)
    shm_size: str = Field(
        "8Gi", description="Size of /dev/shm (vLLM's worker processes share tensors), a quantity such as 8Gi."
    )
    probes: Probes = Field(default_factory=Probes)
    service: Service = Field(default_factory=Service)
    pod_annotations: dict[str, str] = Field(default_factory=dict)
    pod_labels: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    cpu_feature_node_selector: bool = Field(
        True,
        description="For an fp8 KV cache on vLLM's CPU build, select nodes node-feature-discovery labels "
        "feature.node.kubernetes.io/cpu-cpuid.AVX512F=true (vLLM needs AVX-512 for it).",
    )
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    runtime_class_name: str = subdomain_field("e.g. nvidia, where the GPU runtime is not the default")
    priority_class_name: str = subdomain_field("A PriorityClass for the engine pods")
    service_account_name: str = subdomain_field(
        "The engine pods' ServiceAccount (e.g. a cloud workload identity for object storage)"
    )
    extra_volumes: list[PodVolume] = Field(
        default_factory=list,
        description="More pod volumes, each named apart from the chart's own (cache, shm, models, warmup, "
        "object-storage-credentials).",
    )
    extra_volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        description="More mounts in the vLLM container, each naming a volume of extraVolumes or the chart's.",
    )
    init_containers: list[InitContainer] = Field(
        default_factory=list,
        description="Init containers run before the engine (after the embedded model's).",
    )
    pod_disruption_budget: PodDisruptionBudget = Field(default_factory=PodDisruptionBudget)
    pod_security_context: dict[str, Any] = Field(
        default_factory=lambda: {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        description="vLLM's images run as any user once HOME and the caches point at writable volumes; "
        "the default meets Pod Security's restricted level.",
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
    sweep: SweepJob = Field(default_factory=SweepJob)
    extra_objects: list[dict[str, Any] | str] = Field(
        default_factory=list,
        description="Further objects installed with the release, each a manifest (a map, or text that may "
        "use templates such as {{ .Release.Name }}).",
    )
    engines: list[ChartEngineItem] = Field(  # ChartEngineItem is built from these fields, below
        default_factory=list,
        description="Several engines in one release: each item is the top-level values of one engine "
        "(what `kvtune render --as helm-values` and the sweep write) plus its name, laid over the top-level "
        "values; its objects are named RELEASE-kvtune-NAME. Empty = the one top-level engine.",
    )

    @model_validator(mode="after")
    def _thresholds_reachable(self) -> ChartValues:
        # The top level only: an item of `engines` sets part of its values over these, so its own scaler is
        # judged on the merged values, by templates/checks.yaml.
        problems = self.autoscaling.ceiling_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self


# The sections an item of `engines` may set for its own engine; the rest (Locust, the release tests, the
# dashboards and alert rules, extraObjects) are the release's.
ENGINE_ITEM_SECTIONS: tuple[str, ...] = (
    "images", "engine", "model_source", "replicas", "gpu_resource_name", "resources", "cache", "shm_size",
    "probes", "service", "pod_annotations", "pod_labels", "node_selector", "cpu_feature_node_selector",
    "tolerations", "affinity", "runtime_class_name", "priority_class_name", "service_account_name",
    "extra_volumes", "extra_volume_mounts", "init_containers", "pod_disruption_budget",
    "pod_security_context", "security_context", "termination_grace_period_seconds", "kv_events",
    "monitoring", "autoscaling", "inference_pool",
)  # fmt: skip


def _item_field(name: str) -> tuple[Any, Any]:
    """The top-level field NAME as an item may set it: optional, with the same bounds, patterns and
    description (an item's value meets the rules of the value it replaces)."""
    info = ChartValues.model_fields[name]
    item = FieldInfo.merge_field_infos(info, default=None, default_factory=None, alias=to_camel(name))
    return Optional[info.annotation], item  # noqa: UP045 (a runtime type)


_item_fields: dict[str, Any] = {
    "name": (
        str,
        Field(
            pattern=DNS1123_LABEL,
            max_length=20,
            description="The engine's name (lower-case letters, digits and '-'): its objects are named "
            "RELEASE-kvtune-NAME.",
        ),
    ),
    **{name: _item_field(name) for name in ENGINE_ITEM_SECTIONS},
}
ChartEngineItem = create_model(
    "ChartEngineItem",
    __config__=ConfigDict(extra="forbid", populate_by_name=True),
    __doc__="One engine of several: its name and the values it sets over the release's top-level ones.",
    **_item_fields,
)
ChartValues.model_rebuild()


def profile_fields_from_engine(engine: dict[str, Any]) -> dict[str, Any]:
    """The profile fields a chart `engine` section stands for (camelCase keys to the profile's names)."""
    parsed = ChartEngine.model_validate(engine)
    fields = {
        name: getattr(parsed, name) for name in CHART_ENGINE_FIELDS if getattr(parsed, name) is not None
    }
    if parsed.warmup:
        fields["warmup"] = [prefix.model_dump() for prefix in parsed.warmup]
    return fields


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
    if profile.warmup:
        engine["warmup"] = [{"role": prefix.role, "text": prefix.content()} for prefix in profile.warmup]
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
    return lines


def _without_nulls(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def values_schema() -> dict[str, Any]:
    """values.schema.json: the JSON Schema of ChartValues, self-contained (no $refs)."""
    schema = ChartValues.model_json_schema(by_alias=True)
    definitions = schema.pop("$defs", {})
    inlined = _inline(schema, definitions)
    _describe_extra_args(inlined["properties"]["engine"]["properties"]["extraArgs"])
    _admit_removed_keys(inlined)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **_simplify(inlined)}


def _describe_extra_args(extra_args: dict[str, Any]) -> None:
    """What engine.extraArgs may not hold. The chart refuses each such word itself (templates/checks.yaml,
    from expressions generated from vLLM's own parser, so `--por` is refused too), naming the word and
    what to set instead, which a schema's `not` could not say."""
    parser = vllm_parser.parser()
    extra_args["items"] |= {
        "description": f"A vLLM {parser.version} flag or value; not (in any spelling vLLM accepts) "
        + ", ".join(setting.name for setting in refused_settings()),
    }


def _admit_removed_keys(schema: dict[str, Any]) -> None:
    """Removed keys admitted by the schema, at the top and in each item of `engines`, so that the chart's
    own check (templates/checks.yaml) refuses each with what replaces it; an unknown key would be refused
    with no such word."""
    item = schema["properties"]["engines"]["items"]
    for key in removed_keys.REMOVED_KEYS:
        for level in (schema, item):
            node = level
            *parents, last = key.path.split(".")
            for part in parents:
                node = _object_schema(node["properties"][part])
            node["properties"][last] = removed_keys.schema_property(key)


def _object_schema(node: dict[str, Any]) -> dict[str, Any]:
    """The object schema of a section, which an item of `engines` holds as `anyOf: [section, null]`."""
    if "properties" in node:
        return node
    options: list[dict[str, Any]] = [option for option in node.get("anyOf", []) if "properties" in option]
    (found,) = options
    return found


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
