"""KV-cache arithmetic: how many tokens a KV budget holds for a model, before any engine starts.

The same numbers decide whether a profile can serve one `max_model_len` sequence and (for the sweep)
whether a config can hold a workload's concurrency.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

GIB = 1024**3

# The one home of the dtypes kvtune knows: profiles type their fields with these Literals, the platform
# module narrows the KV ones per device, and the byte tables below size pools and weights.
# Names are vLLM's (`--dtype` and `--kv-cache-dtype` choices, vLLM 0.32.0 `vllm/config/cache.py` and
# `vllm/config/model.py`); kvtune offers the KV dtypes whose element size it knows.
ModelDtype = Literal["auto", "bfloat16", "float16", "float32"]
KvCacheDtype = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]
MODEL_DTYPES: tuple[ModelDtype, ...] = get_args(ModelDtype)
KV_CACHE_DTYPES: tuple[KvCacheDtype, ...] = get_args(KvCacheDtype)

# Bytes per element of each model dtype ("auto" = the checkpoint's, 16-bit for every model kvtune ships)
# and of each kv_cache_dtype but "auto" (= the model dtype's).
MODEL_DTYPE_BYTES: dict[ModelDtype, int] = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
KV_DTYPE_BYTES: dict[KvCacheDtype, int] = {"bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The 8-bit float KV dtypes: twice the tokens of a 16-bit pool, behind the quality gate, and on vLLM's
# CPU build only where the host can run them (`platform.cpu_fp8_kv_problem`).
FP8_KV_DTYPES: frozenset[KvCacheDtype] = frozenset({"fp8", "fp8_e4m3", "fp8_e5m2"})


def is_fp8(kv_cache_dtype: str) -> bool:
    """True for an 8-bit float KV cache dtype."""
    return kv_cache_dtype in FP8_KV_DTYPES


def kv_element_bytes(kv_cache_dtype: KvCacheDtype, model_dtype: ModelDtype = "auto") -> int:
    if kv_cache_dtype == "auto":
        return MODEL_DTYPE_BYTES[model_dtype]
    return KV_DTYPE_BYTES[kv_cache_dtype]


@dataclass(frozen=True)
class ModelGeometry:
    """The parts of a model's config that size its KV cache and its weights."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    max_position_embeddings: int
    weight_bytes_per_param: int = 2

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.weight_bytes_per_param

    def kv_bytes_per_token(self, kv_cache_dtype: KvCacheDtype, model_dtype: ModelDtype = "auto") -> int:
        # K and V, for every layer and KV head.
        elem = kv_element_bytes(kv_cache_dtype, model_dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def explain_bytes_per_token(self, kv_cache_dtype: KvCacheDtype, model_dtype: ModelDtype = "auto") -> str:
        elem = kv_element_bytes(kv_cache_dtype, model_dtype)
        return (
            f"2 (K and V) x {self.num_layers} layers x {self.num_kv_heads} KV heads"
            f" x {self.head_dim} head dim"
            f" x {elem} byte{'s' if elem > 1 else ''} ({kv_cache_dtype})"
            f" = {self.kv_bytes_per_token(kv_cache_dtype, model_dtype):,} bytes/token"
        )


# Geometry of models kvtune ships profiles for, so a profile can be checked on a machine that has never
# downloaded the weights (GPU profiles are validated on CPU-only CI). Figures from each model's config.json.
KNOWN_MODELS: dict[str, ModelGeometry] = {
    "smollm2-135m": ModelGeometry(30, 3, 64, 134_515_008, 8192),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ModelGeometry(30, 3, 64, 134_515_008, 8192),
    "meta-llama/Llama-3.1-8B-Instruct": ModelGeometry(32, 8, 128, 8_030_261_248, 131_072),
    "Qwen/Qwen2.5-7B-Instruct": ModelGeometry(28, 4, 128, 7_615_616_512, 32_768),
    "mistralai/Mistral-7B-Instruct-v0.3": ModelGeometry(32, 8, 128, 7_248_023_552, 32_768),
}


def geometry_from_config(config: dict[str, Any]) -> ModelGeometry | None:
    """Read a Hugging Face config.json dict; None when it lacks what the arithmetic needs."""
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads", heads))
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        max_pos = int(config.get("max_position_embeddings", 0))
    except (KeyError, TypeError, ValueError):
        return None
    # Rough parameter count (attention + MLP + embeddings); only used for the weights' share of memory.
    inter = int(config.get("intermediate_size", 4 * hidden))
    vocab = int(config.get("vocab_size", 0))
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter
    return ModelGeometry(layers, kv_heads, head_dim, layers * per_layer + vocab * hidden, max_pos)


def lookup_geometry(model: str) -> ModelGeometry | None:
    """Geometry of a known model name, or of a local model directory's config.json."""
    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model]
    config_path = Path(model) / "config.json"
    try:
        if not config_path.is_file():
            return None
        return geometry_from_config(json.loads(config_path.read_text()))
    except (OSError, ValueError):  # a name too long for a path, or a config that is not JSON: not known
        return None


def kv_tokens(kv_bytes: int, bytes_per_token: int, block_size: int, block_cap: int | None = None) -> int:
    """Tokens a KV pool holds: whole blocks only, optionally capped at a block count."""
    blocks = kv_bytes // (bytes_per_token * block_size)
    if block_cap is not None:
        blocks = min(blocks, block_cap)
    return blocks * block_size


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
