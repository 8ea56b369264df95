"""KV-cache arithmetic: how many tokens a KV budget holds for a model, before any engine starts.

The same numbers decide whether a profile can serve one `max_model_len` sequence and (for the sweep)
whether a config can hold a workload's concurrency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from kvtune import metrics
from kvtune.config_errors import DocumentError, brief
from kvtune.documents import read_json

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
    """The parts of a model's config that size its KV cache and its weights.

    With tensor parallelism (TP) and pipeline parallelism (PP) each GPU (rank) holds a share: its layers and
    its KV heads. The `tp`/`pp` arguments below give one rank's figures; at TP = PP = 1 they are the whole
    model's.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int
    max_position_embeddings: int
    weight_bytes_per_param: int = 2
    # Query heads: TP must divide them (None when unknown, then only the KV heads are checked).
    num_attention_heads: int | None = None

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.weight_bytes_per_param

    def layers_per_rank(self, pp: int = 1) -> int:
        """Layers on the pipeline stage holding the most: vLLM's `get_pp_indices` (0.32.0,
        vllm/distributed/utils.py) gives each stage num_layers // pp and spreads the remainder one layer per
        stage, so the largest holds ceil(num_layers / pp); its pool is the smallest, and the engine's."""
        return -(-self.num_layers // pp)

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads on one TP rank: split evenly, or one replicated head per rank when TP exceeds them
        (vLLM 0.32.0, `QKVParallelLinear`, vllm/model_executor/layers/linear.py)."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(
        self, kv_cache_dtype: KvCacheDtype, model_dtype: ModelDtype = "auto", tp: int = 1, pp: int = 1
    ) -> int:
        # K and V, for every layer and KV head of one rank.
        elem = kv_element_bytes(kv_cache_dtype, model_dtype)
        return 2 * self.layers_per_rank(pp) * self.kv_heads_per_rank(tp) * self.head_dim * elem

    def explain_bytes_per_token(
        self, kv_cache_dtype: KvCacheDtype, model_dtype: ModelDtype = "auto", tp: int = 1, pp: int = 1
    ) -> str:
        elem = kv_element_bytes(kv_cache_dtype, model_dtype)
        layers = f"{self.layers_per_rank(pp)} layers" + (f" ({self.num_layers} / PP {pp})" if pp > 1 else "")
        heads = f"{self.kv_heads_per_rank(tp)} KV heads"
        if tp > 1:
            shared = f"{self.num_kv_heads} / TP {tp}"
            heads += f" ({shared})" if tp <= self.num_kv_heads else f" ({shared}: one replicated per GPU)"
        per_gpu = " per GPU" if tp > 1 or pp > 1 else ""
        return (
            f"2 (K and V) x {layers} x {heads}"
            f" x {self.head_dim} head dim"
            f" x {elem} byte{'s' if elem > 1 else ''} ({kv_cache_dtype})"
            f" = {self.kv_bytes_per_token(kv_cache_dtype, model_dtype, tp, pp):,} bytes/token{per_gpu}"
        )

    def weight_bytes_per_rank(self, model_dtype: ModelDtype = "auto", tp: int = 1, pp: int = 1) -> int:
        """One GPU's share of the weights. An approximation: vLLM splits the layers' matrices across TP and
        the layers across PP, but the embeddings, the LM head and the norms are not split exactly this way
        (the first and last stages hold a little more)."""
        return self.num_params * MODEL_DTYPE_BYTES[model_dtype] // (tp * pp)

    def parallel_problem(self, tp: int, pp: int) -> str | None:
        """Why vLLM cannot split this model TP x PP ways, naming the field to change; None when it can.

        vLLM 0.32.0: the attention heads must divide by TP (`ModelConfig.verify_with_parallel_config`,
        vllm/config/model.py); the KV heads must divide by TP or TP by them (`QKVParallelLinear`); a
        pipeline stage with no layer holds no KV cache, so PP is at most the layer count."""
        heads = self.num_attention_heads
        if heads is not None and heads % tp:
            return (
                f"tensor_parallel_size {tp} does not divide the model's {heads} attention heads, as vLLM "
                f"requires; use one of {self._tp_sizes()}"
            )
        if not self._kv_splits(tp):
            return (
                f"tensor_parallel_size {tp} and the model's {self.num_kv_heads} KV heads: vLLM needs the KV "
                f"heads to divide by TP, or TP by the KV heads; use one of {self._tp_sizes()}"
            )
        if pp > self.num_layers:
            return (
                f"pipeline_parallel_size {pp} exceeds the model's {self.num_layers} layers (a stage "
                f"without a layer has nothing to run); use at most {self.num_layers}"
            )
        return None

    def _tp_sizes(self, most: int = 64) -> str:
        """The TP sizes up to MOST (a profile's bound) vLLM can split this model's heads into."""
        return ", ".join(
            str(n)
            for n in range(1, most + 1)
            if self._kv_splits(n) and (self.num_attention_heads is None or self.num_attention_heads % n == 0)
        )

    def _kv_splits(self, tp: int) -> bool:
        return self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0


# Geometry of models kvtune ships profiles for, so a profile can be checked on a machine that has never
# downloaded the weights (GPU profiles are validated on CPU-only CI). Figures from each model's config.json.
KNOWN_MODELS: dict[str, ModelGeometry] = {
    "smollm2-135m": ModelGeometry(30, 3, 64, 134_515_008, 8192, num_attention_heads=9),
    "HuggingFaceTB/SmolLM2-135M-Instruct": ModelGeometry(30, 3, 64, 134_515_008, 8192, num_attention_heads=9),
    "meta-llama/Llama-3.1-8B-Instruct": ModelGeometry(
        32, 8, 128, 8_030_261_248, 131_072, num_attention_heads=32
    ),
    # 80 layers, 64 query heads, 8 KV heads, hidden 8192 (head dim 128), intermediate 28672, vocab 128256.
    "meta-llama/Llama-3.1-70B-Instruct": ModelGeometry(
        80, 8, 128, 70_553_706_496, 131_072, num_attention_heads=64
    ),
    "Qwen/Qwen2.5-7B-Instruct": ModelGeometry(28, 4, 128, 7_615_616_512, 32_768, num_attention_heads=28),
    "mistralai/Mistral-7B-Instruct-v0.3": ModelGeometry(
        32, 8, 128, 7_248_023_552, 32_768, num_attention_heads=32
    ),
}


def _positive_int(config: dict[str, Any], key: str, source: str) -> int | None:
    """config[key] as a whole number above 0; None when absent or null. A model whose config says 0 heads,
    -3 layers or Infinity has no KV arithmetic: ConfigError naming the field, not a division by zero."""
    value = config.get(key)
    if value is None:
        return None
    whole = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if whole and value == int(value) and value > 0:
        return int(value)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    kinds = {bool: "true or false", str: "a string", list: "a list", dict: "an object"}
    shown = brief(value) if number else kinds.get(type(value), type(value).__name__)
    problem = f"{key} is {shown}, not a positive whole number"
    raise DocumentError(
        f"{source}: {problem}; fix the model's config.json or use another model", path=source, summary=problem
    )


def geometry_from_config(config: dict[str, Any], source: str = "config.json") -> ModelGeometry | None:
    """Read a Hugging Face config.json dict; None when it lacks what the arithmetic needs, ConfigError (naming
    `source` and the field) when a size it gives is not a positive whole number."""
    sizes = {key: _positive_int(config, key, source) for key in _CONFIG_SIZES}
    layers, heads, hidden = sizes["num_hidden_layers"], sizes["num_attention_heads"], sizes["hidden_size"]
    if layers is None or heads is None or hidden is None:
        return None
    kv_heads = sizes["num_key_value_heads"] or heads
    head_dim = sizes["head_dim"] or hidden // heads
    if head_dim == 0:  # hidden_size below the head count, and no head_dim
        problem = (
            f"hidden_size {hidden} is smaller than num_attention_heads {heads}, and head_dim is not given"
        )
        raise DocumentError(f"{source}: {problem}; fix the model's config.json", path=source, summary=problem)
    max_pos = sizes["max_position_embeddings"] or 0
    # Rough parameter count (attention + MLP + embeddings); only used for the weights' share of memory.
    inter = sizes["intermediate_size"] or 4 * hidden
    vocab = sizes["vocab_size"] or 0
    per_layer = hidden * head_dim * (heads + 2 * kv_heads) + heads * head_dim * hidden + 3 * hidden * inter
    return ModelGeometry(
        layers, kv_heads, head_dim, layers * per_layer + vocab * hidden, max_pos, num_attention_heads=heads
    )


# The config.json fields the arithmetic reads: each absent or a positive whole number.
_CONFIG_SIZES = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "head_dim",
    "max_position_embeddings",
    "intermediate_size",
    "vocab_size",
)


def lookup_geometry(model: str) -> ModelGeometry | None:
    """Geometry of a known model name, or of a local model directory's config.json (None when there is
    none); ConfigError naming the file when that config.json cannot be used."""
    if model in KNOWN_MODELS:
        return KNOWN_MODELS[model]
    config_path = Path(model) / "config.json"
    try:
        if not config_path.is_file():
            return None
    except (OSError, ValueError):  # a name too long for a path, a NUL byte: not a local model
        return None
    config = read_json(config_path, "a model's config.json")
    if not isinstance(config, dict):
        raise DocumentError(
            f"{config_path}: is not a JSON object of model settings; fix the model's config.json",
            path=config_path,
            summary="is not a JSON object",
        )
    return geometry_from_config(config, str(config_path))


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


# ---- an engine's pool in bytes, and what its requests need ---------------------------------------------
# Read from the labels of a running engine's `vllm:cache_config_info` (kvtune doctor).

MIB = 1024**2
# A candidate model dtype explains the pool when the blocks its element size gives from
# kv_cache_memory_bytes are within this share of the blocks the engine reports.
_DTYPE_MATCH = 0.1


@dataclass(frozen=True)
class KvBytes:
    """KV bytes per token of the engine's pool, and how they were found (or why they are unknown)."""

    per_token: int | None
    how: str
    fp8_per_token: int | None = None


def label_int(cache: dict[str, str], name: str) -> int | None:
    """A count label of `vllm:cache_config_info`; None when absent, "None" (vLLM's unset) or not a whole
    number (metrics.readable_cache_config says why, for the report)."""
    try:
        return metrics.label_count(cache, name)
    except ValueError:
        return None


def _pool_model_dtype(
    cache: dict[str, str], geometry: ModelGeometry, tp: int = 1, pp: int = 1
) -> tuple[ModelDtype, str]:
    """The model dtype that sized an "auto" KV pool: the one whose element size turns the engine's
    kv_cache_memory_bytes (one GPU's) into the blocks it reports, else vLLM's 16-bit default."""
    memory, blocks = label_int(cache, "kv_cache_memory_bytes"), label_int(cache, "num_gpu_blocks")
    block_size = label_int(cache, "block_size")
    if memory and blocks and block_size and label_int(cache, "num_gpu_blocks_override") is None:
        candidates: tuple[ModelDtype, ...] = ("bfloat16", "float32")
        fits = {
            dtype: kv_tokens(memory, geometry.kv_bytes_per_token("auto", dtype, tp, pp), block_size)
            // block_size
            for dtype in candidates
        }
        best = min(candidates, key=lambda dtype: abs(fits[dtype] - blocks))
        if abs(fits[best] - blocks) <= _DTYPE_MATCH * blocks:
            bits = 8 * MODEL_DTYPE_BYTES[best]
            return best, (
                f"{bits}-bit model dtype: it turns kv_cache_memory_bytes {memory:,} into the {blocks:,} "
                "blocks the engine reports"
            )
    return "auto", "16-bit model dtype assumed (vLLM's auto)"


def resolve_kv_bytes(
    cache: dict[str, str], geometry: ModelGeometry | None, why_no_geometry: str, tp: int = 1, pp: int = 1
) -> KvBytes:
    """KV bytes per token of one GPU (rank) of a TP x PP engine, from the model's geometry and the pool's
    dtype (`vllm:cache_config_info` labels, whose num_gpu_blocks and kv_cache_memory_bytes are one GPU's).

    Without the geometry, an explicit kv_cache_memory_bytes over the pool's tokens still gives the figure.
    """
    cache_dtype = cache.get("cache_dtype", "auto")
    dtype: KvCacheDtype | None
    # float16 is a vLLM choice kvtune's profiles do not offer; its elements are bf16's size.
    dtype = "bfloat16" if cache_dtype == "float16" else _known_kv_dtype(cache_dtype)
    if geometry is not None and dtype is not None:
        model_dtype: ModelDtype = "auto"
        dtype_note = ""
        if dtype == "auto":
            model_dtype, dtype_note = _pool_model_dtype(cache, geometry, tp, pp)
        how = geometry.explain_bytes_per_token(dtype, model_dtype, tp, pp)
        how += f"; {dtype_note}" if dtype_note else ""
        return KvBytes(
            geometry.kv_bytes_per_token(dtype, model_dtype, tp, pp),
            how,
            geometry.kv_bytes_per_token("fp8", tp=tp, pp=pp),
        )
    why = why_no_geometry if geometry is None else f"cache_dtype {cache_dtype}: its element size is unknown"
    memory, blocks = label_int(cache, "kv_cache_memory_bytes"), label_int(cache, "num_gpu_blocks")
    block_size = label_int(cache, "block_size")
    if memory and blocks and block_size and label_int(cache, "num_gpu_blocks_override") is None:
        per_token = memory // (blocks * block_size)
        return KvBytes(
            per_token,
            f"kv_cache_memory_bytes {memory:,} / {blocks * block_size:,} pool tokens = ~{per_token:,} "
            f"bytes/token ({why})",
        )
    return KvBytes(None, why)


def _known_kv_dtype(name: str) -> KvCacheDtype | None:
    for dtype in KV_CACHE_DTYPES:
        if dtype == name:
            return dtype
    return None


@dataclass(frozen=True)
class KvNeed:
    """The KV blocks the peak's requests need at the mean request size, in whole blocks per request."""

    running: int
    waiting: int
    prompt_tokens: float
    output_tokens: float
    block_size: int
    source: str

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    @property
    def tokens_per_request(self) -> int:
        return math.ceil(self.prompt_tokens + self.output_tokens)

    @property
    def blocks_per_request(self) -> int:
        return max(math.ceil(self.tokens_per_request / self.block_size), 1)

    @property
    def blocks(self) -> int:
        return self.requests * self.blocks_per_request

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


def pool_bytes(capacity: metrics.KvCapacity, cache: dict[str, str], kv: KvBytes) -> int | None:
    """The pool's size in bytes: its explicit budget, else its tokens x the bytes per token (None when
    unknown)."""
    explicit = label_int(cache, "kv_cache_memory_bytes")
    if explicit:
        return explicit
    return None if kv.per_token is None else capacity.num_blocks * capacity.block_size * kv.per_token


def mib(n_bytes: float) -> str:
    return f"{math.ceil(n_bytes / MIB):,} MiB"
