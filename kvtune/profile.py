"""Engine profiles: one typed, validated model per vLLM engine, and what it renders (argv, env, serve YAML).

A profile is the single source of each engine setting: the controller's argv, the `vllm serve` YAML and
(later) Helm values are all rendered from it.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Literal, Self

import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvtune import kv_math
from kvtune.config_errors import existing_file, load_yaml_model
from kvtune.platform import (
    CPU_BLOCK_MULTIPLE,
    SUPPORTED_KV_DTYPES,
    Device,
    cpu_fp8_kv_problem,
    detect_device,
)

KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's own default on CPU when a profile leaves block_size unset.
DEFAULT_BLOCK_SIZE: dict[Device, int] = {"cpu": 128, "cuda": 16}


class WarmupPrefix(BaseModel):
    """A shared prefix (system prompt or document) sent once an engine is ready, to fill its prefix cache."""

    model_config = ConfigDict(extra="forbid")

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
        return None if value is None else existing_file(value, info, "warm-up file")

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if (self.text is None) == (self.file is None):
            raise ValueError("give exactly one of 'text' or 'file' for a warm-up prefix")
        return self

    def content(self) -> str:
        return self.text if self.text is not None else Path(str(self.file)).read_text()


class EngineProfile(BaseModel):
    """One vLLM OpenAI-compatible server: model, address, KV budget, cache and batching settings."""

    model_config = ConfigDict(extra="forbid")

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
        None, gt=0, description="Memory of one accelerator; lets a GPU profile's budget be checked offline."
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
        20, ge=0, description="Seconds a stopping engine lets requests in flight finish (0 aborts them)."
    )

    extra_args: list[str] = Field(default_factory=list, description="Further vLLM flags, passed verbatim.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables for the engine.")
    warmup: list[WarmupPrefix] = Field(
        default_factory=list,
        description="Shared prefixes sent once the engine is ready (and after restarts).",
    )

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
        if self.device != "cpu" or not self.kv_cache_dtype.startswith("fp8") or detect_device() != "cpu":
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
        return None if capacity is None else max(capacity - self.effective_block_size, 0)

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
        }
        return {key: value for key, value in options.items() if value is not None}

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
        """A `vllm serve --config` file: the model goes on the command line, the rest in the file."""
        options = self.vllm_options(model_path)
        model = options.pop("model")
        header = f"# vllm serve {model} --config THIS_FILE\n"
        return header + yaml.safe_dump(options, sort_keys=False)

    def serve_command(self, model_path: str | None = None) -> str:
        """The equivalent `vllm serve` shell command, environment included."""
        options = self.vllm_args(model_path)
        model_at = options.index("--model")
        model = options[model_at + 1]
        del options[model_at : model_at + 2]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.engine_env().items())
        return f"{env} {shlex.join(['vllm', 'serve', model, *options])}".strip()

    def to_yaml(self, header: str = "") -> str:
        """This profile as a YAML file `kvtune up` accepts (unset fields left out, paths absolute)."""
        data = self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
        data = {"name": self.name, "device": self.device, "model": self.model} | data
        return header + yaml.safe_dump(data, sort_keys=False)

    def helm_values(self) -> dict[str, Any]:
        """The Helm chart's values for this engine: the profile itself plus what it renders to."""
        return {
            "engine": {
                "profile": self.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
                | {"name": self.name, "model": self.model},
                "vllmArgs": self.vllm_args(),
                "env": self.engine_env(),
            }
        }

    def engine_env(self) -> dict[str, str]:
        env = {"VLLM_TARGET_DEVICE": self.device} if self.device == "cpu" else {}
        return env | self.env


def load_profile(path: Path) -> EngineProfile:
    return load_yaml_model(EngineProfile, path)
