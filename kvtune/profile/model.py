"""Engine profiles: one typed, validated model per vLLM engine, and what it renders (argv, env, serve YAML).

A profile is the single source of each engine setting: the controller's argv, the `vllm serve` YAML and
the Helm chart's values (kvtune.helm.values) are all rendered from it.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import sys
import unicodedata
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import ByteSize, Field, ValidationInfo, field_validator, model_validator

from kvtune import kv_math, vllm_parser
from kvtune.config_errors import ConfigError, DocumentModel, brief, existing_file
from kvtune.credentials import looks_secret, posix_name_problem, value_looks_secret
from kvtune.documents import dump_yaml, load_yaml_model, read_text
from kvtune.files import name_problem
from kvtune.kv_math import KvCacheDtype, ModelDtype, is_fp8
from kvtune.platform import (
    CPU_BIND_MODES,
    CPU_BLOCK_MULTIPLE,
    CPU_COMPILE_ENV,
    CPU_RESERVED_CORES_ENV,
    CPU_THREADS_BIND_ENV,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SUPPORTED_KV_DTYPES,
    Device,
    cpu_bind_host_problem,
    cpu_fp8_kv_problem,
    cpu_reserve_host_problem,
    detect_device,
    parse_core_lists,
    tokens_after_null_block,
)

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM reads its API key from this variable (vllm/envs.py, 0.32): kvtune passes it so, never on argv.
VLLM_API_KEY_ENV = "VLLM_API_KEY"
API_KEY_FILE_BYTES = 64 * 1024


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Every flag `EngineProfile.vllm_options` renders, and the field that sets it (a test keeps them in step):
# the same flag in extra_args would make kvtune poll one port or describe one config while vLLM runs another.
MANAGED_FLAGS: dict[str, str] = {
    "model": "model",
    "served-model-name": "served_model_name",
    "host": "host",
    "port": "port",
    "max-model-len": "max_model_len",
    "dtype": "dtype",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "kv-cache-memory-bytes": "kv_cache_memory_bytes",
    "num-gpu-blocks-override": "num_gpu_blocks_override",
    "enable-prefix-caching": "enable_prefix_caching",
    "kv-cache-dtype": "kv_cache_dtype",
    "block-size": "block_size",
    "max-num-seqs": "max_num_seqs",
    "max-num-batched-tokens": "max_num_batched_tokens",
    "enable-chunked-prefill": "enable_chunked_prefill",
    "enforce-eager": "enforce_eager",
    "shutdown-timeout": "shutdown_timeout",
    "kv-events-config": "kv_events_port",
    "api-key": "api_key_env",  # on argv the key would show in `ps` and in the engine log
}

# The same, by each flag's setting: its destination in vLLM's argument parser (a test checks each resolves
# so), whatever spelling of the flag extra_args uses.
_FIELD_OF_SETTING: dict[str, str] = {flag.replace("-", "_"): field for flag, field in MANAGED_FLAGS.items()}

# vLLM settings no profile field sets that kvtune keeps for itself, and why extra_args may not set them.
_SERVES_HTTPS = (
    "serves HTTPS, and kvtune (like the chart's probes) reaches the engine over plain HTTP; remove it"
)
RESERVED_SETTINGS: dict[str, str] = {
    "config": "reads further flags from a file kvtune never checks; remove it and write those flags in the "
    "profile instead",
    "help": "prints vLLM's help and exits instead of serving; remove it",
    "headless": "starts no API server, and kvtune reaches the engine through its API server; remove it",
    "uds": "serves on a Unix socket instead of the host and port kvtune reaches the engine at; remove it",
    "grpc": "serves gRPC on the port instead of the HTTP API kvtune reaches the engine through; remove it",
    "ssl_certfile": _SERVES_HTTPS,
    "ssl_keyfile": _SERVES_HTTPS,
}


def setting_problem(setting: vllm_parser.Setting) -> str | None:
    """Why extra_args may not set this vLLM setting, ending the sentence "'--por' is vLLM's --port, which
    ..."; None when they may.

    A setting carries a credential when it takes a value and its name says so as an environment variable's
    would (api_key, hf_token; not the switch allow_credentials, nor long_prefill_token_threshold)."""
    field = _FIELD_OF_SETTING.get(setting.dest)
    if setting.takes_value and looks_secret(setting.dest):
        fix = (
            f"name the environment variable holding it in the profile field {field!r}"
            if field
            else "list the environment variable vLLM reads it from (e.g. HF_TOKEN) under secret_env"
        )
        return (
            f"carries a credential, and extra_args are written to every output; remove it and {fix} instead"
        )
    if field:
        return f"the profile sets itself; remove it and set the profile field {field!r} instead"
    return RESERVED_SETTINGS.get(setting.dest)


def refused_settings() -> list[vllm_parser.Setting]:
    """Every setting of the installed vLLM's server that extra_args may not set."""
    return [setting for setting in vllm_parser.parser().settings() if setting_problem(setting)]


def extra_args_problem(args: list[str]) -> str | None:
    """Why vLLM would not run ARGS as further flags of a profile's engine, judged by vLLM's own parser (so
    every spelling of a flag counts: abbreviations, `=value`, `_` for `-`, `--no-`, `--flag.key`); None
    when it would."""
    for index, word in enumerate(args):
        if any(unicodedata.category(c) == "Cc" for c in word):
            # Each word is written on one line of a script or a YAML comment: a newline would start another.
            return f"extra_args[{index}]: holds a control character (a newline, a tab); write it on one line"
        if value_looks_secret(word):
            return (
                f"extra_args[{index}]: looks like a credential (not shown), and extra_args are written to "
                "every output; pass it in an environment variable listed under secret_env instead"
            )
    if not args:
        return None  # vLLM's parser takes seconds to build: only built for a profile with extra_args
    try:
        flags = vllm_parser.parser().flags(args)
    except vllm_parser.ExtraArgError as refused:
        return str(refused)
    for flag in flags:
        written = flag.text.split("=", 1)[0]  # never the value: it may be the credential refused
        problem = setting_problem(flag.setting)
        if problem:
            return f"extra_args[{flag.index}]: {written!r} is vLLM's {flag.setting.name}, which {problem}"
        if flag.inline_value and not flag.setting.takes_value:
            return (
                f"extra_args[{flag.index}]: {written!r} is vLLM's {flag.option_string}, which takes no "
                f"value; write {flag.option_string} alone"
            )
    return None


# Every environment variable `EngineProfile.engine_env` renders from a field, and that field: the same name
# in env (or secret_env) would make the profile and the sweep report describe one binding while vLLM ran
# another.
MANAGED_ENV: dict[str, str] = {
    CPU_THREADS_BIND_ENV: "cpu_threads_bind",
    CPU_RESERVED_CORES_ENV: "cpu_reserved_cores",
}


def managed_env_problem(name: str, where: str) -> str | None:
    if name not in MANAGED_ENV:
        return None
    return (
        f"repeats a variable the profile sets itself; remove it from {where} and set the profile field "
        f"{MANAGED_ENV[name]!r} instead"
    )


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
    """One vLLM OpenAI-compatible server: model, address, KV budget, cache and batching settings."""

    # Every number finite: .inf or .nan in YAML is a typo wherever a number is meant.

    name: str = Field("engine", description="Engine name used in logs and the control API.")
    device: Device = Field(
        default_factory=detect_device,
        description="cpu (vLLM's CPU build) or cuda; defaults to the installed vLLM's platform.",
    )
    model: str = Field(description="Embedded model name (smollm2-135m), Hugging Face id, or local directory.")
    served_model_name: str | None = Field(None, description="Name clients use; defaults to `model`.")
    host: str = Field("127.0.0.1", description="Address the server binds.")
    port: int = Field(8000, ge=1, le=65535, description="Port the server binds.")
    max_model_len: int | None = Field(None, gt=0, description="Longest sequence (prompt + output) in tokens.")
    dtype: ModelDtype = Field("auto", description="Weights and activations type; auto = the checkpoint's.")

    # KV budget: at most one of the two; neither means vLLM's default.
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Fraction of accelerator memory vLLM may use (on CPU: of host memory)."
    )
    kv_cache_memory_bytes: ByteSize | None = Field(
        None, gt=0, description="Explicit KV cache size, bytes or a size such as '1GiB'."
    )
    num_gpu_blocks_override: int | None = Field(
        None, gt=0, description="Cap on KV blocks (forces KV pressure, e.g. in tests)."
    )
    accelerator_memory_gib: float | None = Field(
        None,
        gt=0,
        le=65536,
        allow_inf_nan=False,
        description="Memory of one accelerator in GiB; lets a GPU profile's budget be checked offline.",
    )

    enable_prefix_caching: bool = Field(True, description="Automatic prefix caching.")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="KV cache element type; fp8 doubles capacity.")
    kv_cache_dtype_fallback: KvCacheDtype | None = Field(
        None,
        description="Used instead of an fp8 kv_cache_dtype on a host that cannot keep fp8 KV "
        "(vLLM's CPU build needs AVX-512 or AMX); unset = refuse such a host.",
    )
    block_size: int | None = Field(None, gt=0, description="Tokens per KV block (CPU: a multiple of 32).")
    max_num_seqs: int | None = Field(None, gt=0, description="Most sequences batched at once.")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget of one scheduler step.")
    enable_chunked_prefill: bool | None = Field(None, description="Split long prefills across steps.")
    enforce_eager: bool = Field(False, description="Skip graph capture / torch.compile (fast start on CPU).")
    shutdown_timeout: int = Field(
        20,
        ge=0,
        le=LONGEST_WAIT_S,
        description="Seconds a stopping engine lets requests in flight finish (0 aborts them).",
    )
    kv_events_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Send KV-cache events (blocks stored and evicted) over ZMQ to host:port, where the "
        "router of `kvtune up` listens (its kv_events policy); unset = no events.",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=64,
        description="Engines `kvtune up` starts from this profile, behind its router: replica i listens on "
        "port + i (and kv_events_port + i) and gets its own share of the CPU cores or GPU i.",
    )

    # Thread placement of vLLM's CPU build (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_NUM_OF_RESERVED_CPU); unset
    # means vLLM's default: auto binding that keeps one core per local rank (one without tensor parallelism)
    # for the API server.
    cpu_threads_bind: str | None = Field(
        None,
        coerce_numbers_to_str=True,  # `cpu_threads_bind: 1` in YAML is core 1
        description="CPU build: cores vLLM's compute threads run on: auto (vLLM picks them), nobind, or "
        "core ids such as 0-1 or 0,2-3 (one list per rank, joined by '|').",
    )
    cpu_reserved_cores: int | None = Field(
        None,
        ge=0,
        description="CPU build, auto binding: cores kept for the API server instead of compute; 0 computes "
        "on every core (fastest alone, but the server then competes with compute under load).",
    )

    ready_timeout_s: float = Field(
        1800.0,
        gt=0,
        le=LONGEST_WAIT_S,
        description="Seconds an engine may take to load its weights and serve (a first start may download "
        "them: 16 GB take minutes).",
    )

    extra_args: list[str] = Field(
        default_factory=list,
        description="Further vLLM flags, passed verbatim; a flag a profile field or kvtune sets, or one "
        "carrying a credential, is refused in any spelling vLLM reads (--por for --port).",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for the engine; written to every output, so never credentials "
        "(list those under secret_env).",
    )
    secret_env: list[str] = Field(
        default_factory=list,
        description="Names of environment variables (e.g. HF_TOKEN) the engine takes from the environment "
        "kvtune runs in; their values are never written to a file, a log or an API answer.",
    )
    api_key_env: str | None = Field(
        None,
        description="Environment variable holding the API key clients must send (vLLM's --api-key); "
        "every kvtune client sends it, and it is never written anywhere.",
    )
    api_key_file: Path | None = Field(
        None, description="A file whose first line is the API key; relative to the profile's folder."
    )
    warmup: list[WarmupPrefix] = Field(
        default_factory=list,
        description="Shared prefixes sent once the engine is ready (and after restarts).",
    )

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

    @model_validator(mode="after")
    def _replica_ports_exist(self) -> Self:
        for field, first in (("port", self.port), ("kv_events_port", self.kv_events_port)):
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
            problem = posix_name_problem(name)
            if problem:
                raise ValueError(f"env: {problem}")
            managed = managed_env_problem(name, "env")
            if managed:
                raise ValueError(f"env.{name}: {managed}")
            if looks_secret(name) or value_looks_secret(value):
                raise ValueError(
                    f"env.{name}: looks like a credential, and env values are written to every output "
                    f"(best.yaml, vllm-serve.sh, kvtune render); remove it from env, list {name} under "
                    "secret_env and set it in the environment kvtune runs in"
                )
            if "\0" in value:
                raise ValueError(f"env.{name}: the value holds a NUL character, which no environment can")
        return env

    @field_validator("secret_env")
    @classmethod
    def _secret_names(cls, names: list[str], info: ValidationInfo) -> list[str]:
        for index, name in enumerate(names):
            problem = posix_name_problem(name)
            if problem:
                raise ValueError(f"secret_env[{index}]: {problem}")
            managed = managed_env_problem(name, "secret_env")
            if managed:
                raise ValueError(f"secret_env[{index}]: {managed}")
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
        problem = extra_args_problem(self.extra_args)
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

    @field_validator("cpu_threads_bind")
    @classmethod
    def _threads_bind(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        _refuse_on_cuda("cpu_threads_bind", info)
        if value not in CPU_BIND_MODES:
            try:
                parse_core_lists(value)
            except ValueError as exc:
                raise ValueError(
                    f"{brief(value)} is not a thread binding vLLM reads: {exc}; use auto, nobind, or core "
                    "ids such as 0-1 or 0,2-3 (one list per rank, joined by '|')"
                ) from None
        return value

    @field_validator("cpu_reserved_cores")
    @classmethod
    def _reserved_cores(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is None:
            return None
        _refuse_on_cuda("cpu_reserved_cores", info)
        bind = info.data.get("cpu_threads_bind")
        if bind not in (None, "auto"):
            raise ValueError(
                f"vLLM keeps cores back only when it binds threads itself, and ignores it with "
                f"cpu_threads_bind {brief(bind)}; remove cpu_reserved_cores, or set cpu_threads_bind: auto"
            )
        return value

    @model_validator(mode="after")
    def _cpu_cores_on_host(self) -> Self:
        # Checked only where vLLM's CPU build runs, so a CPU profile can still be rendered on any machine.
        if self.device != "cpu" or detect_device() != "cpu":
            return self
        if self.cpu_threads_bind is not None:
            problem = cpu_bind_host_problem(self.cpu_threads_bind)
            if problem:
                raise ValueError(
                    f"cpu_threads_bind: {brief(self.cpu_threads_bind)} cannot be used on this host: {problem}"
                )
        if self.cpu_reserved_cores is not None:
            problem = cpu_reserve_host_problem(self.cpu_reserved_cores)
            if problem:
                raise ValueError(f"cpu_reserved_cores: {problem}")
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
    def _budget_holds_one_sequence(self) -> Self:
        problem = self.capacity_problem()
        if problem:
            field = "kv_cache_memory_bytes" if self.kv_cache_memory_bytes else "gpu_memory_utilization"
            raise ValueError(f"{field}: {problem}")
        return self

    # ---- derived facts -------------------------------------------------------------------------------

    def host_kv_dtype_problem(self) -> str | None:
        """Why this host cannot keep the fp8 KV cache (only CPU profiles on CPU hosts are checked)."""
        if self.device != "cpu" or not is_fp8(self.kv_cache_dtype) or detect_device() != "cpu":
            return None
        geometry = kv_math.lookup_geometry(self.model)
        return cpu_fp8_kv_problem(geometry.head_dim if geometry else None)

    def adapted_to_host(self) -> tuple[EngineProfile, str | None]:
        """The profile this host will really run, and a note when the KV dtype fell back."""
        problem = self.host_kv_dtype_problem()
        if problem is None or self.kv_cache_dtype_fallback is None:
            return self, None
        fallback = self.kv_cache_dtype_fallback
        note = f"kv_cache_dtype {self.kv_cache_dtype} -> {fallback}: {problem}"
        return self.model_copy(update={"kv_cache_dtype": fallback, "kv_cache_dtype_fallback": None}), note

    @property
    def api_model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def effective_block_size(self) -> int:
        return self.block_size or DEFAULT_BLOCK_SIZE[self.device]

    def kv_budget_bytes(self, geometry: kv_math.ModelGeometry) -> tuple[int, str] | None:
        """The KV pool in bytes and how it was derived, when the profile fixes it; None for vLLM's default."""
        if self.kv_cache_memory_bytes is not None:
            return int(self.kv_cache_memory_bytes), f"kv_cache_memory_bytes {self.kv_cache_memory_bytes:,}"
        if self.gpu_memory_utilization is not None and self.accelerator_memory_gib is not None:
            total = self.accelerator_memory_gib * kv_math.GIB
            weights = geometry.num_params * kv_math.MODEL_DTYPE_BYTES[self.dtype]
            kv = int(total * self.gpu_memory_utilization - weights)
            return kv, (
                f"gpu_memory_utilization {self.gpu_memory_utilization} x {self.accelerator_memory_gib} GiB"
                f" - {kv_math.format_bytes(weights)} weights = at most {kv_math.format_bytes(kv)}"
            )
        return None

    def kv_capacity_tokens(self) -> int | None:
        """Tokens the KV pool holds by arithmetic, when model geometry and budget are both known."""
        geometry = kv_math.lookup_geometry(self.model)
        budget = geometry and self.kv_budget_bytes(geometry)
        if not geometry or not budget:
            return None
        per_token = geometry.kv_bytes_per_token(self.kv_cache_dtype, self.dtype)
        return kv_math.kv_tokens(
            max(budget[0], 0), per_token, self.effective_block_size, self.num_gpu_blocks_override
        )

    def usable_kv_tokens(self) -> int | None:
        """Tokens requests can use: vLLM keeps one block of the pool back (its null block)."""
        capacity = self.kv_capacity_tokens()
        return None if capacity is None else tokens_after_null_block(capacity, self.effective_block_size)

    def capacity_problem(self) -> str | None:
        """Why this KV budget cannot hold one `max_model_len` sequence, with the arithmetic; else None."""
        geometry = kv_math.lookup_geometry(self.model)
        if geometry is None:
            return None
        budget = self.kv_budget_bytes(geometry)
        seq_len = self.max_model_len or geometry.max_position_embeddings
        capacity = self.usable_kv_tokens()
        if budget is None or capacity is None or capacity >= seq_len:
            return None
        per_token = geometry.kv_bytes_per_token(self.kv_cache_dtype, self.dtype)
        cap = ""
        if self.num_gpu_blocks_override is not None:
            cap = f", capped at num_gpu_blocks_override {self.num_gpu_blocks_override} blocks"
        needed = seq_len * per_token
        return (
            f"the KV budget leaves {capacity:,} usable tokens (one block is vLLM's), fewer than one "
            f"max_model_len sequence of {seq_len:,}: "
            f"{budget[1]} / ({geometry.explain_bytes_per_token(self.kv_cache_dtype, self.dtype)})"
            f" in blocks of {self.effective_block_size}{cap}; "
            f"raise the budget to at least {kv_math.format_bytes(needed)} ({needed:,} bytes), "
            f"use kv_cache_dtype fp8, or lower max_model_len"
        )

    # ---- rendering -------------------------------------------------------------------------------------

    def vllm_options(self, model_path: str | None = None) -> dict[str, Any]:
        """vLLM server options by their flag names; the one mapping argv and serve YAML are rendered from."""
        options: dict[str, Any] = {
            "model": model_path or self.model,
            "served-model-name": self.api_model_name,
            "host": self.host,
            "port": self.port,
            "max-model-len": self.max_model_len,
            "dtype": None if self.dtype == "auto" else self.dtype,
            "gpu-memory-utilization": self.gpu_memory_utilization,
            "kv-cache-memory-bytes": int(self.kv_cache_memory_bytes) if self.kv_cache_memory_bytes else None,
            "num-gpu-blocks-override": self.num_gpu_blocks_override,
            "enable-prefix-caching": self.enable_prefix_caching,
            "kv-cache-dtype": self.kv_cache_dtype,
            "block-size": self.block_size,
            "max-num-seqs": self.max_num_seqs,
            "max-num-batched-tokens": self.max_num_batched_tokens,
            "enable-chunked-prefill": self.enable_chunked_prefill,
            "enforce-eager": self.enforce_eager or None,
            "shutdown-timeout": self.shutdown_timeout,
            "kv-events-config": self.kv_events_config(),
        }
        return {key: value for key, value in options.items() if value is not None}

    def kv_events_config(self) -> str | None:
        """vLLM's --kv-events-config: events sent to host:kv_events_port (vLLM connects to an explicit
        address and binds only wildcards; the router binds it, on loopback by default)."""
        if self.kv_events_port is None:
            return None
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{self.host}:{self.kv_events_port}",
            "topic": f"kv@{self.name}",
        }
        return json.dumps(config, separators=(",", ":"))

    @property
    def kv_events_url(self) -> str | None:
        return None if self.kv_events_port is None else f"tcp://{self.host}:{self.kv_events_port}"

    def vllm_args(self, model_path: str | None = None) -> list[str]:
        args: list[str] = []
        for flag, value in self.vllm_options(model_path).items():
            if value is True:
                args.append(f"--{flag}")
            elif value is False:
                args.append(f"--no-{flag}")
            else:
                args += [f"--{flag}", str(value)]
        return args + list(self.extra_args)

    def argv(self, model_path: str | None = None, python: str = sys.executable) -> list[str]:
        return [python, "-m", API_SERVER_MODULE, *self.vllm_args(model_path)]

    def serve_yaml(self, model_path: str | None = None) -> str:
        """A `vllm serve --config` file: the model and extra_args go on the command line (its header says
        which), the rest in the file."""
        options = self.vllm_options(model_path)
        model = options.pop("model")
        # extra_args stay on the command line: the file holds settings, they are flags as vLLM reads them.
        extra = "".join(f" {shlex.quote(arg)}" for arg in self.extra_args)
        header = f"# vllm serve {shlex.quote(str(model))} --config THIS_FILE{extra}\n"
        return header + dump_yaml(options)

    def launch_command(self, model_path: str | None = None, python: str = sys.executable) -> list[str]:
        """The engine's command as a shell runs it: `env NAME=value ... python -m vllm... --flags`.

        The module form works on vLLM's CPU build too, whose `vllm` console script cannot start; secrets
        are not in it (they come from the environment, see `serve_script`).
        """
        env = [f"{name}={value}" for name, value in self.engine_env().items()]
        return (["env", *env] if env else []) + self.argv(model_path, python)

    def serve_script(self, model_path: str | None = None, comments: list[str] | None = None) -> str:
        """A POSIX sh script that starts this engine: every word quoted, credentials taken from the caller's
        environment at run time (and refused with a message when missing), never written into the file."""
        lines = ["#!/bin/sh", *("# " + " ".join(line.splitlines()) for line in comments or [])]
        if model_path and model_path != self.model:
            lines.append("# model " + " ".join(f"{self.model!r} is served from {model_path}".splitlines()))
        lines.append("set -eu")
        for name in self.secret_env:
            lines.append(
                f': "${{{name}:?set {name} in the environment (the profile lists it in secret_env)}}"'
            )
        if self.api_key_env:
            lines.append(
                f'{VLLM_API_KEY_ENV}="${{{self.api_key_env}:?set {self.api_key_env} to the API key clients '
                f'send (api_key_env)}}"'
            )
        elif self.api_key_file:
            lines.append(f'{VLLM_API_KEY_ENV}="$(head -n 1 {shlex.quote(str(self.api_key_file))})"')
        if self.api_key_env or self.api_key_file:
            lines.append(f"export {VLLM_API_KEY_ENV}")
        lines.append(f"exec {shlex.join(self.launch_command(model_path))}")
        return "\n".join(lines) + "\n"

    # ---- credentials, read at launch and never stored -------------------------------------------------

    def api_key(self) -> str | None:
        """The API key clients must send, from the variable or file the profile names; None without one."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env, "").strip()
            if not key:
                raise ConfigError(
                    f"engine {self.name!r}: api_key_env: the environment variable {self.api_key_env} is "
                    "not set or empty; export it with the engine's API key"
                )
            return key
        if self.api_key_file:
            try:
                # A key is a line; a larger file is not one (and is not read whole into memory).
                text = read_text(Path(self.api_key_file), "a file holding the key", limit=API_KEY_FILE_BYTES)
            except ConfigError as exc:
                raise ConfigError(f"engine {self.name!r}: api_key_file: {exc}") from None
            lines = text.splitlines()
            if not lines or not lines[0].strip():
                raise ConfigError(
                    f"engine {self.name!r}: api_key_file {self.api_key_file} is empty; put the key on its "
                    "first line"
                )
            return lines[0].strip()
        return None

    def secret_values(self) -> dict[str, str]:
        """The `secret_env` variables from this process's environment; ConfigError naming a missing one."""
        missing = [name for name in self.secret_env if not os.environ.get(name)]
        if missing:
            raise ConfigError(
                f"engine {self.name!r}: secret_env: {', '.join(missing)} not set in the environment; "
                "export it before starting (its value is never written by kvtune)"
            )
        return {name: os.environ[name] for name in self.secret_env}

    def launch_env(self) -> dict[str, str]:
        """What the engine process gets on top of the caller's environment: the rendered env, the secrets
        and the API key (vLLM reads VLLM_API_KEY), so no credential is ever on its command line."""
        key = self.api_key()
        return self.engine_env() | self.secret_values() | ({VLLM_API_KEY_ENV: key} if key else {})

    def check_credentials(self) -> None:
        """Raise ConfigError now, before anything starts, when a credential the profile names is missing."""
        self.launch_env()

    def to_yaml(self, header: str = "") -> str:
        """This profile as a YAML file `kvtune up` accepts (unset fields left out, paths absolute)."""
        data = self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        data = {"name": self.name, "device": self.device, "model": self.model} | data
        return header + dump_yaml(data)

    def effective_max_num_batched_tokens(self) -> int | None:
        """The step token budget the engine runs with: the profile's, else vLLM's default where that is
        fixed (chunked prefill on; without it vLLM widens the budget to the longest sequence)."""
        if self.max_num_batched_tokens is not None or self.enable_chunked_prefill is False:
            return self.max_num_batched_tokens
        return DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device]

    def engine_env(self) -> dict[str, str]:
        env: dict[str, str] = (
            {"VLLM_TARGET_DEVICE": self.device} | CPU_COMPILE_ENV if self.device == "cpu" else {}
        )
        if self.cpu_threads_bind is not None:
            env[CPU_THREADS_BIND_ENV] = self.cpu_threads_bind
        if self.cpu_reserved_cores is not None:
            env[CPU_RESERVED_CORES_ENV] = str(self.cpu_reserved_cores)
        return env | self.env


def _refuse_on_cuda(field: str, info: ValidationInfo) -> None:
    if info.data.get("device") == "cuda":
        env_name = next(name for name, owner in MANAGED_ENV.items() if owner == field)
        raise ValueError(
            f"only vLLM's CPU build reads it (as {env_name}), and this profile's device is cuda; remove "
            f"{field}, or set device: cpu"
        )


def load_profile(path: Path) -> EngineProfile:
    return load_yaml_model(EngineProfile, path)
