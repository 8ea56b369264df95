"""Read a vLLM engine's Prometheus metrics: counters, gauges and its real KV capacity.

The one home of the vLLM metric names kvtune reads: every other module (load runner, Locust files,
benchmarks, tests) takes them from here, so a rename in vLLM is one edit. Names are as scraped from
`GET /metrics`: counters carry `_total`, histograms `_sum`/`_count`/`_bucket`. All were read from vLLM
0.32.0 (`vllm/v1/metrics/loggers.py`, the V1 engine's Prometheus logger) and checked on a live engine.
Removed names many public dashboards still query, and so show "No data": `vllm:gpu_cache_usage_perc`,
`vllm:gpu_prefix_cache_queries`/`_hits`/`_hit_rate`, `vllm:num_preemptions` without `_total`.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Info gauge (value 1) whose labels describe the KV pool the engine really allocated: cache_dtype,
# block_size, enable_prefix_caching, num_gpu_blocks, kv_cache_size_tokens, ... (vLLM 0.32.0).
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# Counters (vLLM 0.32.0). Prefix-cache queries and hits count prompt tokens: hit rate = hits / queries.
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits_total"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
# Prompt tokens served from the prefix cache instead of being computed.
PROMPT_TOKENS_CACHED = "vllm:prompt_tokens_cached_total"
# Finished requests, labelled `finished_reason` (stop, length, abort, error, ...).
REQUEST_SUCCESS = "vllm:request_success_total"

# Gauges (vLLM 0.32.0). KV usage is a fraction, 0-1; waiting by reason has a `reason` label
# ("capacity": no KV or batch room, "deferred").
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
REQUESTS_RUNNING = "vllm:num_requests_running"
REQUESTS_WAITING = "vllm:num_requests_waiting"
REQUESTS_WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"

# Histograms in seconds (vLLM 0.32.0), by base name: the samples are `<name>_sum`, `<name>_count` and
# `<name>_bucket`. Queue: arrival to first scheduled; prefill: first scheduled to first token.
QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
TTFT_SECONDS = "vllm:time_to_first_token_seconds"
ITL_SECONDS = "vllm:inter_token_latency_seconds"
E2E_SECONDS = "vllm:e2e_request_latency_seconds"
# Histogram of tokens per engine step (vLLM 0.32.0), prefill and decode together: a scheduler step holds at
# most max_num_batched_tokens, and every running stream's next token waits for the whole step.
ITERATION_TOKENS = "vllm:iteration_tokens_total"
# Histograms of tokens per finished request (vLLM 0.32.0), by base name: prompt tokens prefilled, tokens
# generated. Their `_sum` / `_count` is a request's mean size, which sizes the KV pool it needs.
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"

# kvtune's router (kvtune/router/proxy.py, server.py), as scraped from its /metrics.
ROUTER_REQUESTS = "kvtune_router_requests_total"  # by engine, policy and the decision's reason
ROUTER_REFUSED = "kvtune_router_refused_requests_total"  # by reason; never forwarded
ROUTER_UPSTREAM_ERRORS = "kvtune_router_upstream_errors_total"  # by engine and kind
ROUTER_KV_EVENTS_RESYNCS = "kvtune_router_kv_events_resyncs_total"  # by engine and cause
ROUTER_MATCHED_BLOCKS = "kvtune_router_matched_prefix_blocks"  # histogram, blocks
ROUTER_REPORTED_BLOCKS = "kvtune_router_kv_events_reported_blocks"  # gauge by engine: its KV-event view
ROUTER_OVERHEAD_SECONDS = "kvtune_router_overhead_seconds"  # histogram: arrival to upstream call sent


def hit_rate(hits: float, queries: float) -> float | None:
    """Share of queried prompt tokens found in the prefix cache; None when nothing was queried."""
    return hits / queries if queries else None


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
