"""The engine profile: one typed, validated model per vLLM engine, each field declared with its facts
outside the profile (kvtune.profile.fields); what it renders, its credentials, its KV arithmetic and its
adaptation to the host live in the package's other modules, behind the same methods."""

from __future__ import annotations

import sys
import unicodedata
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from pydantic import ByteSize, Field, ValidationInfo, field_validator, model_validator

from kvtune import kv_math
from kvtune.config_errors import ConfigError, DocumentModel, brief, existing_file
from kvtune.credentials import posix_name_problem
from kvtune.documents import load_yaml_model, read_text
from kvtune.files import name_problem
from kvtune.kv_math import KvCacheDtype, ModelDtype
from kvtune.platform import (
    CPU_BLOCK_MULTIPLE,
    CPU_RESERVED_CORES_ENV,
    CPU_THREADS_BIND_ENV,
    SUPPORTED_KV_DTYPES,
    Device,
    detect_device,
)
from kvtune.profile import capacity, credentials, host, knob_values, rendering
from kvtune.profile.argv_text import variable_reference_problem
from kvtune.profile.extra_args import ExtraArgsJudge
from kvtune.profile.fields import FieldFacts, argv_fields, env_fields, managed_env, managed_flags

# vLLM's load formats kvtune offers (vLLM 0.32.0, vllm/config/load.py `LoadConfig.load_format`): those that
# read a real checkpoint without further configuration. Left out: dummy (random weights), tensorizer (needs
# its own config), instanttensor and ipc_cache (CUDA-only loaders with a daemon or library of their own),
# modelexpress and plugins.
LoadFormat = Literal[
    "auto",
    "safetensors",
    "pt",
    "npcache",
    "runai_streamer",
    "runai_streamer_sharded",
    "sharded_state",
    "mistral",
]

# A day: the longest an engine may take to start, or to let requests finish when stopped; a longer timeout
# is a typo (or .inf), not a wait anyone means.
LONGEST_WAIT_S = 86400


class WarmupPrefix(DocumentModel):
    """A shared prefix (system prompt or document) sent once an engine is ready, to fill its prefix cache."""

    role: Literal["system", "raw"] = Field(
        "system",
        description="system: sent as the chat system message (users' chats start with it); "
        "raw: sent as a completion prompt that users' prompts start with.",
    )
    text: str | None = Field(None, description="The prefix itself.")
    file: Path | None = Field(
        None, description="A file holding the prefix; relative to the profile's folder."
    )

    @field_validator("file")
    @classmethod
    def _resolve_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        path = existing_file(value, info, "warm-up file")
        try:
            read_text(path, "a warm-up text file")
        except ConfigError as exc:
            raise ValueError(f"warm-up file: {exc}") from None
        return path

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.text is None) == (self.file is None):
            raise ValueError("give exactly one of 'text' or 'file' for a warm-up prefix")
        return self

    def content(self) -> str:
        return self.text if self.text is not None else read_text(Path(str(self.file)), "a warm-up text file")


class EngineProfile(DocumentModel):
    """One vLLM OpenAI-compatible server: model, address, KV budget, cache and batching settings.

    Each field's FieldFacts says which vLLM flag or variable it renders to, whether the chart carries it
    (and what stands for it in a pod when not) and whether a sweep may vary it."""

    # Every number finite: .inf or .nan in YAML is a typo wherever a number is meant.

    name: Annotated[
        str,
        # On argv in the KV-event topic of --kv-events-config.
        FieldFacts(chart="the release's name names the engine's objects", argv=True),
    ] = Field("engine", description="Engine name used in logs and the control API.")
    device: Annotated[Device, FieldFacts(chart=True)] = Field(
        default_factory=detect_device,
        description="cpu (vLLM's CPU build) or cuda; defaults to the installed vLLM's platform.",
    )
    model: Annotated[str, FieldFacts(chart=True, flag="model")] = Field(
        description="Embedded model name (smollm2-135m), Hugging Face id, or local directory."
    )
    served_model_name: Annotated[
        str | None,
        FieldFacts(chart=True, flag="served-model-name", flag_value=lambda p: p.api_model_name),
    ] = Field(None, description="Name clients use; defaults to `model`.")
    host: Annotated[str, FieldFacts(chart="the chart binds all interfaces in the pod", flag="host")] = Field(
        "127.0.0.1", description="Address the server binds."
    )
    port: Annotated[int, FieldFacts(chart="the chart's containerPort and service.port", flag="port")] = Field(
        8000, ge=1, le=65535, description="Port the server binds."
    )
    max_model_len: Annotated[int | None, FieldFacts(chart=True, flag="max-model-len", knob=True)] = Field(
        None, gt=0, description="Longest sequence (prompt + output) in tokens."
    )
    dtype: Annotated[
        ModelDtype,
        FieldFacts(chart=True, flag="dtype", flag_value=lambda p: None if p.dtype == "auto" else p.dtype),
    ] = Field("auto", description="Weights and activations type; auto = the checkpoint's.")

    revision: Annotated[str | None, FieldFacts(chart=True, flag="revision")] = Field(
        None,
        description="The model revision to load: a commit id (pins the weights), branch or tag; vLLM "
        "loads the tokenizer at the same revision unless told otherwise (its tokenizer_revision follows "
        "revision); unset = the default branch.",
    )
    load_format: Annotated[LoadFormat | None, FieldFacts(chart=True, flag="load-format")] = Field(
        None,
        description="How vLLM reads the weights: auto (safetensors, else PyTorch .bin), safetensors, pt, "
        "npcache, runai_streamer (streams safetensors, also from object storage), runai_streamer_sharded "
        "or sharded_state (pre-sharded checkpoints), mistral (consolidated files); unset = auto.",
    )

    # Parallelism of one engine on one host (a pod): TP splits every layer's heads across GPUs, PP splits
    # the layers, DP runs full copies with pools of their own. At 1 no flag is rendered (vLLM's default).
    tensor_parallel_size: Annotated[
        int,
        FieldFacts(
            chart=True,
            flag="tensor-parallel-size",
            flag_value=lambda p: _above_one(p.tensor_parallel_size),
            knob=True,
        ),
    ] = Field(
        1,
        ge=1,
        le=64,
        description="GPUs (CPU: worker processes) each layer is split across; each holds 1/TP of the "
        "weights and of the KV heads. Must suit the model's heads.",
    )
    pipeline_parallel_size: Annotated[
        int,
        FieldFacts(
            chart=True,
            flag="pipeline-parallel-size",
            flag_value=lambda p: _above_one(p.pipeline_parallel_size),
        ),
    ] = Field(
        1,
        ge=1,
        le=64,
        description="Pipeline stages the layers are split across (each TP GPUs); at most the model's layers.",
    )
    data_parallel_size: Annotated[
        int,
        FieldFacts(
            chart=True,
            flag="data-parallel-size",
            flag_value=lambda p: _above_one(p.data_parallel_size),
        ),
    ] = Field(
        1,
        ge=1,
        le=64,
        description="Copies of the model behind one API server, each on TP x PP GPUs of its own with its "
        "own KV pool (the KV figures are per copy).",
    )

    # KV budget: at most one of the two; neither means vLLM's default.
    gpu_memory_utilization: Annotated[
        float | None, FieldFacts(chart=True, flag="gpu-memory-utilization", knob=True)
    ] = Field(
        None, gt=0, le=1, description="Fraction of accelerator memory vLLM may use (on CPU: of host memory)."
    )
    kv_cache_memory_bytes: Annotated[
        ByteSize | None,
        FieldFacts(
            chart=True,
            flag="kv-cache-memory-bytes",
            flag_value=lambda p: int(p.kv_cache_memory_bytes) if p.kv_cache_memory_bytes else None,
            knob=True,
        ),
    ] = Field(None, gt=0, description="Explicit KV cache size, bytes or a size such as '1GiB'.")
    num_gpu_blocks_override: Annotated[
        int | None, FieldFacts(chart=True, flag="num-gpu-blocks-override", knob=True)
    ] = Field(None, gt=0, description="Cap on KV blocks (forces KV pressure, e.g. in tests).")
    accelerator_memory_gib: Annotated[
        float | None,
        FieldFacts(chart="an offline check of a GPU budget; the node's device is what it is"),
    ] = Field(
        None,
        gt=0,
        le=65536,
        allow_inf_nan=False,
        description="Memory of one accelerator in GiB; lets a GPU profile's budget be checked offline.",
    )

    enable_prefix_caching: Annotated[
        bool, FieldFacts(chart=True, flag="enable-prefix-caching", knob=True)
    ] = Field(True, description="Automatic prefix caching.")
    kv_cache_dtype: Annotated[KvCacheDtype, FieldFacts(chart=True, flag="kv-cache-dtype", knob=True)] = Field(
        "auto", description="KV cache element type; fp8 doubles capacity."
    )
    kv_cache_dtype_fallback: Annotated[
        KvCacheDtype | None,
        FieldFacts(chart="vLLM has no fallback of its own: give fp8 KV to CPU nodes with AVX-512"),
    ] = Field(
        None,
        description="Used instead of an fp8 kv_cache_dtype on a host that cannot keep fp8 KV "
        "(vLLM's CPU build needs AVX-512 or AMX); unset = refuse such a host.",
    )
    block_size: Annotated[int | None, FieldFacts(chart=True, flag="block-size", knob=True)] = Field(
        None, gt=0, description="Tokens per KV block (CPU: a multiple of 32)."
    )
    # The offload tier (vLLM 0.32.0 CacheConfig): evicted KV blocks are copied to host memory and loaded back
    # on a later hit instead of being prefilled again. CUDA (and XPU) builds only.
    kv_offloading_size: Annotated[float | None, FieldFacts(chart=True, flag="kv-offloading-size")] = Field(
        None,
        gt=0,
        le=1 << 20,
        allow_inf_nan=False,
        description="GiB of host memory for the KV offload tier, in all (vLLM divides it among the "
        "tensor-parallel ranks); unset = no offloading. Not on vLLM's CPU build, whose KV cache is in host "
        "memory already.",
    )
    kv_offloading_backend: Annotated[
        Literal["native", "lmcache"] | None, FieldFacts(chart=True, flag="kv-offloading-backend")
    ] = Field(
        None,
        description="What keeps the offload tier: native (vLLM's own host-memory tier, sized by "
        "kv_offloading_size) or lmcache (an LMCache server, which sizes its own store); unset = native. "
        "Needs kv_offloading_size, which turns offloading on.",
    )
    # Block residency (vLLM 0.32.0 ObservabilityConfig): histograms of how long KV blocks live, sit idle
    # before eviction and wait between reuses, which `kvtune doctor` judges the pool's size by.
    kv_cache_metrics: Annotated[
        bool,
        FieldFacts(chart=True, flag="kv-cache-metrics", flag_value=lambda p: p.kv_cache_metrics or None),
    ] = Field(
        False,
        description="Export vLLM's KV block residency histograms (vllm:kv_block_lifetime_seconds, "
        "vllm:kv_block_idle_before_evict_seconds, vllm:kv_block_reuse_gap_seconds).",
    )
    kv_cache_metrics_sample: Annotated[
        float | None, FieldFacts(chart=True, flag="kv-cache-metrics-sample")
    ] = Field(
        None,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="Share of KV blocks the residency histograms follow, above 0 and at most 1; unset = "
        "vLLM's 0.01. Needs kv_cache_metrics.",
    )
    max_num_seqs: Annotated[int | None, FieldFacts(chart=True, flag="max-num-seqs", knob=True)] = Field(
        None, gt=0, description="Most sequences batched at once."
    )
    max_num_batched_tokens: Annotated[
        int | None, FieldFacts(chart=True, flag="max-num-batched-tokens", knob=True)
    ] = Field(None, gt=0, description="Token budget of one scheduler step.")
    enable_chunked_prefill: Annotated[
        bool | None, FieldFacts(chart=True, flag="enable-chunked-prefill", knob=True)
    ] = Field(None, description="Split long prefills across steps.")
    enforce_eager: Annotated[
        bool, FieldFacts(chart=True, flag="enforce-eager", flag_value=lambda p: p.enforce_eager or None)
    ] = Field(False, description="Skip graph capture / torch.compile (fast start on CPU).")
    shutdown_timeout: Annotated[int, FieldFacts(chart=True, flag="shutdown-timeout")] = Field(
        20,
        ge=0,
        le=LONGEST_WAIT_S,
        description="Seconds a stopping engine lets requests in flight finish (0 aborts them).",
    )
    kv_events_port: Annotated[
        int | None,
        FieldFacts(
            chart="kvEvents (the chart binds the pod's port and names the topic by pod address)",
            flag="kv-events-config",
            flag_value=lambda p: p.kv_events_config(),
        ),
    ] = Field(
        None,
        ge=1,
        le=65535,
        description="Send KV-cache events (blocks stored and evicted) over ZMQ to host:port, where the "
        "router of `kvtune up` listens (its kv_events policy); unset = no events.",
    )
    kv_events_replay_port: Annotated[
        int | None,
        FieldFacts(
            chart="not in the chart (vLLM's replay serves `kvtune up`'s router workers; in a cluster the "
            "InferencePool's scheduler keeps its own view)"
        ),
    ] = Field(
        None,
        ge=1,
        le=65535,
        description="Serve vLLM's KV-event replay (its recent event batches, by sequence number) on this "
        "port, on loopback unless host is another address: a router that starts or restarts rebuilds the "
        "engine's view from it instead of starting empty. Needs kv_events_port; part of its "
        "--kv-events-config.",
    )
    replicas: Annotated[
        int,
        FieldFacts(
            chart="the chart's replicas (one engine per pod; routing across them is the InferencePool's)"
        ),
    ] = Field(
        1,
        ge=1,
        le=64,
        description="Engines `kvtune up` starts from this profile, behind its router: replica i listens on "
        "port + i (and kv_events_port + i) and gets its own share of the CPU cores or GPU i.",
    )

    # Thread placement of vLLM's CPU build (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU); unset
    # means vLLM's default: auto binding that keeps one core per local rank (one without tensor parallelism)
    # for the API server.
    cpu_threads_bind: Annotated[str | None, FieldFacts(chart=True, env=CPU_THREADS_BIND_ENV, knob=True)] = (
        Field(
            None,
            coerce_numbers_to_str=True,  # `cpu_threads_bind: 1` in YAML is core 1
            description="CPU build: cores vLLM's compute threads run on: auto (vLLM picks them), nobind, or "
            "core ids such as 0-1 or 0,2-3 (one list per rank, joined by '|').",
        )
    )
    cpu_reserved_cores: Annotated[
        int | None, FieldFacts(chart=True, env=CPU_RESERVED_CORES_ENV, knob=True)
    ] = Field(
        None,
        ge=0,
        description="CPU build, auto binding: cores kept for the API server instead of compute; 0 computes "
        "on every core (fastest alone, but the server then competes with compute under load).",
    )

    ready_timeout_s: Annotated[float, FieldFacts(chart=True)] = Field(
        1800.0,
        gt=0,
        le=LONGEST_WAIT_S,
        description="Seconds an engine may take to load its weights and serve (a first start may download "
        "them: 16 GB take minutes).",
    )

    extra_args: Annotated[list[str], FieldFacts(chart=True, argv=True)] = Field(
        default_factory=list,
        description="Further vLLM flags, passed verbatim; a flag a profile field or kvtune sets, or one "
        "carrying a credential, is refused in any spelling vLLM reads (--por for --port).",
    )
    env: Annotated[dict[str, str], FieldFacts(chart=True, env_map=True)] = Field(
        default_factory=dict,
        description="Environment variables for the engine; written to every output, so never credentials "
        "(list those under secret_env).",
    )
    secret_env: Annotated[list[str], FieldFacts(chart=True)] = Field(
        default_factory=list,
        description="Names of environment variables (e.g. HF_TOKEN) the engine takes from the environment "
        "kvtune runs in; their values are never written to a file, a log or an API answer.",
    )
    api_key_env: Annotated[
        str | None,
        # On argv the key would show in `ps` and in the engine log: vLLM gets it as VLLM_API_KEY instead.
        FieldFacts(
            chart="engine.apiKeySecret: the key comes from a Kubernetes Secret",
            flag="api-key",
            flag_value=lambda p: None,
            argv=False,
        ),
    ] = Field(
        None,
        description="Environment variable holding the API key clients must send (vLLM's --api-key); "
        "every kvtune client sends it, and it is never written anywhere.",
    )
    api_key_file: Annotated[
        Path | None, FieldFacts(chart="engine.apiKeySecret: the key comes from a Kubernetes Secret")
    ] = Field(None, description="A file whose first line is the API key; relative to the profile's folder.")
    warmup: Annotated[
        list[WarmupPrefix],
        FieldFacts(
            chart="engine.warmup, the prefixes' texts (files read in), sent by the pod's postStart hook"
        ),
    ] = Field(
        default_factory=list,
        description="Shared prefixes sent once the engine is ready (and after restarts).",
    )

    # ---- validation ------------------------------------------------------------------------------------

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        problem = name_problem(name)
        if problem:
            raise ValueError(f"{problem}, e.g. cpu-small")
        return name

    @field_validator("model", "served_model_name")
    @classmethod
    def _one_line(cls, value: str | None, info: ValidationInfo) -> str | None:
        # Written into headers, scripts and YAML comments: a newline there would start a line of its own.
        if value is not None and (not value.strip() or any(unicodedata.category(c) == "Cc" for c in value)):
            raise ValueError(
                f"{info.field_name} must be one line of text without control characters (a model id such as "
                "org/name, or a folder path)"
            )
        return value

    @field_validator("revision")
    @classmethod
    def _plain_revision(cls, value: str | None) -> str | None:
        # A revision is one word on the command line and in scripts: no spaces, no control characters.
        if value is not None and (
            not value or any(c.isspace() or unicodedata.category(c) == "Cc" for c in value)
        ):
            raise ValueError(
                "must be one word without spaces or control characters: a commit id, branch or tag such "
                "as main"
            )
        return value

    @model_validator(mode="after")
    def _no_variable_reference_on_argv(self) -> Self:
        # First of the checks across fields: `$(` is refused as such wherever else the text would fail.
        for field in argv_fields(type(self)):
            problem = variable_reference_problem(field, getattr(self, field))
            if problem:
                raise ValueError(problem)
        # Fields whose own check reads their text (env, a thread binding) refuse it there first.
        for field in env_fields(type(self)):
            problem = variable_reference_problem(field, getattr(self, field), "env")
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _replica_ports_exist(self) -> Self:
        if self.kv_events_replay_port is not None and self.kv_events_port is None:
            raise ValueError(
                "kv_events_replay_port is set without kv_events_port: replay serves the events an engine "
                "publishes; set kv_events_port too, or remove kv_events_replay_port"
            )
        ports = (
            ("port", self.port),
            ("kv_events_port", self.kv_events_port),
            ("kv_events_replay_port", self.kv_events_replay_port),
        )
        for field, first in ports:
            if first is not None and first + self.replicas - 1 > 65535:
                raise ValueError(
                    f"replicas {self.replicas} from {field} {first} would need ports past 65535; lower "
                    f"{field} to {65536 - self.replicas} or less, or lower replicas"
                )
        return self

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            problem = credentials.env_problem(name, value, _managed_env_problem(cls, name, "env"))
            if problem:
                raise ValueError(problem)
        return env

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, names: list[str], info: ValidationInfo) -> list[str]:
        for index, name in enumerate(names):
            problem = posix_name_problem(name) or _managed_env_problem(cls, name, "secret_env")
            if problem:
                raise ValueError(f"secret_env[{index}]: {problem}")
            if name in (info.data.get("env") or {}):
                raise ValueError(f"secret_env[{index}]: {name} is also set in env; remove it from env")
        return names

    @field_validator("api_key_env")
    @classmethod
    def _api_key_name(cls, name: str | None) -> str | None:
        problem = None if name is None else posix_name_problem(name)
        if problem:
            raise ValueError(problem)
        return name

    @field_validator("api_key_file")
    @classmethod
    def _api_key_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and info.data.get("api_key_env") is not None:
            raise ValueError("set only one of api_key_env or api_key_file")
        return None if value is None else existing_file(value, info, "API key file")

    @model_validator(mode="after")
    def _no_managed_flags_in_extra_args(self) -> Self:
        problem = ExtraArgsJudge(managed_flags(type(self))).problem(self.extra_args)
        if problem:
            raise ValueError(problem)
        return self

    @field_validator("kv_cache_memory_bytes")
    @classmethod
    def _one_budget(cls, value: ByteSize | None, info: ValidationInfo) -> ByteSize | None:
        if value is not None and info.data.get("gpu_memory_utilization") is not None:
            raise ValueError(
                "set only one KV budget: remove either gpu_memory_utilization (a fraction of memory) "
                "or kv_cache_memory_bytes (an explicit size)"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _dtype_on_platform(cls, value: str, info: ValidationInfo) -> str:
        device = info.data.get("device")
        if device in SUPPORTED_KV_DTYPES and value not in SUPPORTED_KV_DTYPES[device]:
            raise ValueError(
                f"{value!r} is not a KV cache dtype vLLM supports on {device}; "
                f"use one of {', '.join(SUPPORTED_KV_DTYPES[device])}"
            )
        return value

    @field_validator("block_size")
    @classmethod
    def _block_size_on_platform(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("device") == "cpu" and value % CPU_BLOCK_MULTIPLE:
            raise ValueError(
                f"{value} is not a multiple of {CPU_BLOCK_MULTIPLE}, which vLLM's CPU attention needs; "
                "use 32, 64 or 128"
            )
        return value

    @field_validator("kv_offloading_size", "kv_offloading_backend")
    @classmethod
    def _offloading_on_platform(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.data.get("device") == "cpu":
            raise ValueError(
                "vLLM's CPU build keeps its KV cache in host memory already and refuses to start with an "
                "offload tier ('CPU Offloading is currently only supported on CUDA-alike and XPU GPUs', vLLM "
                f"0.32); remove {info.field_name}, or set device: cuda"
            )
        return value

    @field_validator("kv_offloading_backend")
    @classmethod
    def _backend_needs_a_size(cls, value: str | None, info: ValidationInfo) -> str | None:
        # A size that was refused is missing from info.data: its own error already says what to fix.
        size_unset = "kv_offloading_size" in info.data and info.data["kv_offloading_size"] is None
        if value is not None and size_unset:
            raise ValueError(
                f"vLLM offloads only when kv_offloading_size is set, and ignores the backend {value!r} "
                "without it; set kv_offloading_size (GiB of host memory), or remove kv_offloading_backend"
            )
        return value

    @field_validator("kv_cache_metrics_sample")
    @classmethod
    def _sample_needs_metrics(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("kv_cache_metrics") is False:
            raise ValueError(
                "samples the residency histograms that kv_cache_metrics turns on, and it is off; set "
                "kv_cache_metrics: true, or remove kv_cache_metrics_sample"
            )
        return value

    @field_validator("cpu_threads_bind")
    @classmethod
    def _threads_bind(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        _refuse_on_cuda(cls, "cpu_threads_bind", info)
        problem = host.threads_bind_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("cpu_reserved_cores")
    @classmethod
    def _reserved_cores(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        _refuse_on_cuda(cls, "cpu_reserved_cores", info)
        bind = info.data.get("cpu_threads_bind")
        if bind not in (None, "auto"):
            raise ValueError(
                f"vLLM keeps cores back only when it binds threads itself, and ignores it with "
                f"cpu_threads_bind {brief(bind)}; remove cpu_reserved_cores, or set cpu_threads_bind: auto"
            )
        return value

    @model_validator(mode="after")
    def _parallel_fits_model(self) -> Self:
        geometry = kv_math.lookup_geometry(self.model)
        problem = geometry and geometry.parallel_problem(
            self.tensor_parallel_size, self.pipeline_parallel_size
        )
        if problem:
            raise ValueError(f"{problem} ({self.model})")
        return self

    @model_validator(mode="after")
    def _parallel_ranks(self) -> Self:
        ranks = host.cpu_ranks(self)
        if ranks > 1 and self.replicas > 1:
            raise ValueError(
                f"replicas {self.replicas} with {host.ranks_text(self)}: `kvtune up` gives each replica "
                "one GPU (on CPU one core list); set replicas 1, or data_parallel_size for copies behind "
                "one server"
            )
        problem = host.threads_bind_ranks_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _cpu_cores_on_host(self) -> Self:
        problem = host.cpu_cores_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _kv_dtype_on_host(self) -> Self:
        problem = self.host_kv_dtype_problem()
        if problem and self.kv_cache_dtype_fallback is None:
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} cannot be used on this host: {problem}; "
                "use kv_cache_dtype auto, or set kv_cache_dtype_fallback: auto to fall back "
                "where fp8 is unavailable"
            )
        return self

    @model_validator(mode="after")
    def _weights_fit_one_gpu(self) -> Self:
        problem = capacity.weights_problem(self)
        if problem:
            raise ValueError(f"tensor_parallel_size: {problem}")
        return self

    @model_validator(mode="after")
    def _budget_holds_one_sequence(self) -> Self:
        problem = self.capacity_problem()
        if problem:
            field = "kv_cache_memory_bytes" if self.kv_cache_memory_bytes else "gpu_memory_utilization"
            raise ValueError(f"{field}: {problem}")
        return self

    # ---- derived facts (kvtune.profile.host, .capacity) --------------------------------------------------

    @property
    def api_model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_url(self) -> str | None:
        return None if self.kv_events_port is None else f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def kv_events_replay_url(self) -> str | None:
        return rendering.kv_events_replay_endpoint(self)

    @property
    def effective_block_size(self) -> int:
        return capacity.block_size(self)

    def host_kv_dtype_problem(self) -> str | None:
        return host.kv_dtype_problem(self)

    def adapted_to_host(self) -> tuple[EngineProfile, str | None]:
        return host.adapted(self)

    def kv_budget_bytes(self, geometry: kv_math.ModelGeometry) -> tuple[int, str] | None:
        return capacity.kv_budget_bytes(self, geometry)

    def kv_capacity_tokens(self) -> int | None:
        return capacity.kv_capacity_tokens(self)

    def usable_kv_tokens(self) -> int | None:
        return capacity.usable_kv_tokens(self)

    def capacity_problem(self) -> str | None:
        return capacity.capacity_problem(self)

    def effective_max_num_batched_tokens(self) -> int | None:
        return capacity.max_num_batched_tokens(self)

    # ---- rendering (kvtune.profile.rendering) -------------------------------------------------------------

    def vllm_options(self, model_path: str | None = None) -> dict[str, Any]:
        return rendering.vllm_options(self, model_path)

    def kv_events_config(self) -> str | None:
        return rendering.kv_events_config(self)

    def vllm_args(self, model_path: str | None = None) -> list[str]:
        return rendering.vllm_args(self, model_path)

    def argv(self, model_path: str | None = None, python: str = sys.executable) -> list[str]:
        return rendering.argv(self, model_path, python)

    def serve_yaml(self, model_path: str | None = None) -> str:
        return rendering.serve_yaml(self, model_path)

    def launch_command(self, model_path: str | None = None, python: str = sys.executable) -> list[str]:
        return rendering.launch_command(self, model_path, python)

    def serve_script(self, model_path: str | None = None, comments: list[str] | None = None) -> str:
        return rendering.serve_script(self, model_path, comments)

    def engine_env(self) -> dict[str, str]:
        return rendering.engine_env(self)

    def to_yaml(self, header: str = "") -> str:
        return rendering.to_yaml(self, header)

    def with_knobs(self, values: dict[str, Any]) -> EngineProfile:
        """This profile with some fields set otherwise, as a sweep sets its knobs (profile.knob_values)."""
        return knob_values.applied(self, values)

    # ---- credentials, read at launch and never stored (kvtune.profile.credentials) -----------------------

    def api_key(self) -> str | None:
        return credentials.api_key(self)

    def secret_values(self) -> dict[str, str]:
        return credentials.secret_values(self)

    def launch_env(self) -> dict[str, str]:
        return credentials.launch_env(self)

    def check_credentials(self) -> None:
        """Raise ConfigError now, before anything starts, when a credential the profile names is missing."""
        credentials.launch_env(self)


def _above_one(size: int) -> int | None:
    """A parallel size as its flag's value: left out at vLLM's default 1."""
    return size if size > 1 else None


def _managed_env_problem(profile_class: type[EngineProfile], name: str, where: str) -> str | None:
    field = managed_env(profile_class).get(name)
    if field is None:
        return None
    return (
        f"repeats a variable the profile sets itself; remove it from {where} and set the profile field "
        f"{field!r} instead"
    )


def _refuse_on_cuda(profile_class: type[EngineProfile], field: str, info: ValidationInfo) -> None:
    if info.data.get("device") == "cuda":
        env_name = next(name for name, owner in managed_env(profile_class).items() if owner == field)
        raise ValueError(
            f"only vLLM's CPU build reads it (as {env_name}), and this profile's device is cuda; remove "
            f"{field}, or set device: cpu"
        )


def load_profile(path: Path) -> EngineProfile:
    return load_yaml_model(EngineProfile, path)
