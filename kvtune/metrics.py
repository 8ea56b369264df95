"""Read a vLLM engine's Prometheus metrics: counters, gauges and its real KV capacity."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

CACHE_CONFIG_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    return [
        Sample(sample.name, dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def scrape(url: str, client: httpx.Client | None = None) -> list[Sample]:
    """GET {url}/metrics and parse it."""
    if client is None:
        with httpx.Client(timeout=10.0) as own:
            return scrape(url, own)
    response = client.get(f"{url}/metrics")
    response.raise_for_status()
    return parse(response.text)


def total(samples: list[Sample], name: str) -> float:
    """Sum of a metric over all its label sets (a counter as exported, e.g. `..._total`)."""
    return sum(s.value for s in samples if s.name == name)


def cache_config(samples: list[Sample]) -> dict[str, str]:
    """Labels of `vllm:cache_config_info`: block size, KV dtype, blocks and tokens the engine really has."""
    for sample in samples:
        if sample.name == CACHE_CONFIG_INFO:
            return sample.labels
    return {}


@dataclass(frozen=True)
class KvCapacity:
    """The KV pool an engine actually allocated, as it reports it."""

    cache_dtype: str
    block_size: int
    num_blocks: int
    tokens: int
    prefix_caching: bool

    @classmethod
    def from_samples(cls, samples: list[Sample]) -> KvCapacity | None:
        info = cache_config(samples)
        if not info.get("num_gpu_blocks"):
            return None
        block_size = int(info.get("block_size", 0))
        blocks = int(info["num_gpu_blocks"])
        tokens = int(info.get("kv_cache_size_tokens") or blocks * block_size)
        return cls(
            cache_dtype=info.get("cache_dtype", "auto"),
            block_size=block_size,
            num_blocks=blocks,
            tokens=tokens,
            prefix_caching=info.get("enable_prefix_caching", "").lower() == "true",
        )
