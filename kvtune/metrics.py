"""Read a vLLM engine's Prometheus metrics: counters, gauges and its real KV capacity.

The one home of the vLLM metric names kvtune reads: every other module (load runner, Locust files,
benchmarks, tests) takes them from here, so a rename in vLLM is one edit. Names are as scraped from
`GET /metrics`: counters carry `_total`, histograms `_sum`/`_count`/`_bucket`. All were read from vLLM
0.32.0 (`vllm/v1/metrics/loggers.py`, the V1 engine's Prometheus logger) and checked on a live engine.
Removed names many public dashboards still query, and so show "No data": `vllm:gpu_cache_usage_perc`,
`vllm:gpu_prefix_cache_queries`/`_hits`/`_hit_rate`, `vllm:num_preemptions` without `_total`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtune import http_client

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

# Prompt tokens by where their KV came from (vLLM 0.32.0): `source` is local_compute (prefilled here),
# local_cache_hit (this engine's prefix cache) or external_kv_transfer (a KV connector: the offload tier,
# another instance). The cached ones by tier: `source` device, host (the offload tier in host memory), disk,
# p2p or external_unspecified; they sum to the prefix-cache hits plus the external ones.
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
PROMPT_TOKENS_CACHED_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
# The KV connector's prefix cache (vLLM 0.32.0; the offload tier is one): queried and hit prompt tokens,
# as the local prefix cache counts them. Exported as 0 by every engine, connector or not.
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries_total"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits_total"

# Histograms of KV block residency in seconds, by base name (vLLM 0.32.0, `vllm/v1/core/kv_cache_metrics.py`),
# exported only with `--kv-cache-metrics` and for the share of blocks `--kv-cache-metrics-sample` picks
# (default 0.01). All three are observed when a sampled block is handed out again (evicted): its lifetime
# since allocation, its idle time since its last prefix-cache hit (or allocation), and the gaps between its
# last (at most four) hits. A block is "reused" only by a hit: the gap from its allocation to its first hit
# is not one, a block never evicted (a prefix that stays cached) shows no gap at all, and a prefix evicted
# before its next hit comes back as a new block with no history. So the gaps are those of reuses that
# outlasted their wait, counted once the block is lost.
KV_BLOCK_LIFETIME_SECONDS = "vllm:kv_block_lifetime_seconds"
KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS = "vllm:kv_block_idle_before_evict_seconds"
KV_BLOCK_REUSE_GAP_SECONDS = "vllm:kv_block_reuse_gap_seconds"
BLOCK_RESIDENCY = (KV_BLOCK_LIFETIME_SECONDS, KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS, KV_BLOCK_REUSE_GAP_SECONDS)

# Counters of the KV offload tier (vLLM 0.32.0 OffloadingConnector, `--kv-offloading-size` with the native
# backend; `vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py`): bytes copied from the
# accelerator to host memory and back. They have no sample until the tier's first transfer, and only CUDA
# (and XPU) builds offload: vLLM's CPU build refuses to start with it.
KV_OFFLOAD_STORE_BYTES = "vllm:kv_offload_store_bytes_total"
KV_OFFLOAD_LOAD_BYTES = "vllm:kv_offload_load_bytes_total"
KV_OFFLOAD = (KV_OFFLOAD_STORE_BYTES, KV_OFFLOAD_LOAD_BYTES)

# kvtune's router (kvtune/router/router_metrics.py), as scraped from its /metrics.
ROUTER_REQUESTS = "kvtune_router_requests_total"  # by engine, policy and the decision's reason
ROUTER_REFUSED = "kvtune_router_refused_requests_total"  # by reason; never forwarded
ROUTER_UPSTREAM_ERRORS = "kvtune_router_upstream_errors_total"  # by engine and kind
ROUTER_KV_EVENTS_RESYNCS = "kvtune_router_kv_events_resyncs_total"  # by engine and cause
ROUTER_MATCHED_BLOCKS = "kvtune_router_matched_prefix_blocks"  # histogram, blocks
ROUTER_REPORTED_BLOCKS = "kvtune_router_kv_events_reported_blocks"  # gauge by engine: its KV-event view
ROUTER_OVERHEAD_SECONDS = "kvtune_router_overhead_seconds"  # histogram: arrival to upstream call sent
ROUTER_KV_EVENTS_REJECTED = "kvtune_router_kv_events_rejected_total"  # by engine and reason; skipped
ROUTER_BACKGROUND_FAILURES = "kvtune_router_background_failures_total"  # by engine and task; restarted


def hit_rate(hits: float, queries: float) -> float | None:
    """Share of queried prompt tokens found in the prefix cache; None when nothing was queried."""
    return hits / queries if queries else None


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class ExpositionError(ValueError):
    """A body that is not in the Prometheus text format; str() names the first line that is not."""


class ImpossibleMetrics(ExpositionError):
    """Numbers no single vLLM engine exports together; str() names the series and says so (`impossible`)."""


@dataclass(frozen=True)
class Exposition:
    """A /metrics body as read: the samples that can be used, and why the others were left out."""

    samples: list[Sample]
    skipped: dict[str, str] = field(default_factory=dict)  # sample name -> why (its first), e.g. "is +Inf"
    skipped_count: int = 0

    def skipped_text(self, most: int = 3) -> str:
        """e.g. "2 samples skipped: vllm:prefix_cache_hits_total is +Inf; ..." ("" when none were)."""
        if not self.skipped:
            return ""
        reasons = [f"{name} {why}" for name, why in self.skipped.items()]
        more = f" (and {len(reasons) - most} more)" if len(reasons) > most else ""
        count = self.skipped_count
        return f"{count} sample{'s' * (count != 1)} skipped: " + "; ".join(reasons[:most]) + more


def read_exposition(text: str) -> Exposition:
    """Read a /metrics body with prometheus_client's parser; ExpositionError when it is not that format,
    ImpossibleMetrics when its numbers cannot be one engine's (`impossible`).

    Samples that carry no number are left out with a reason instead of poisoning every sum they enter: a
    value that is not finite (+Inf is legitimate only as a bucket's `le`, never as a value), a bucket whose
    `le` is not a number. The facts read from them are then unknown, and the others still stand.
    """
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        raise ExpositionError(_first_bad_line(text)) from None
    samples: list[Sample] = []
    skipped: dict[str, str] = {}
    for family in families:
        for sample in family.samples:
            why = _unusable(family.type, sample.name, sample.labels, float(sample.value))
            if why:
                skipped.setdefault(sample.name, why)
            else:
                samples.append(Sample(sample.name, dict(sample.labels), float(sample.value)))
    problem = impossible(samples, skipped)
    if problem:
        raise ImpossibleMetrics(problem)
    return Exposition(samples, skipped, sum(len(family.samples) for family in families) - len(samples))


def _unusable(kind: str, name: str, labels: Mapping[str, str], value: float) -> str:
    if not math.isfinite(value):
        return f"is {_number(value)}"
    if name.endswith("_bucket") and kind in ("histogram", "gaugehistogram"):
        bound = labels.get("le")
        if bound is None:
            return "has no le label"
        try:
            upper = float(bound)
        except ValueError:
            upper = math.nan
        if math.isnan(upper):
            return f"has le={bound[:20]!r}, not a number"
    return ""


def _number(value: float) -> str:
    return "NaN" if math.isnan(value) else "+Inf" if value > 0 else "-Inf"


def _first_bad_line(text: str, most: int = 100_000) -> str:
    """Which line breaks the format: found by reading the lines one at a time, only once the whole failed."""
    for number, line in enumerate(text.splitlines()[:most], start=1):
        if not line.strip():
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except ValueError:
            return f"line {number} is not in the Prometheus text format: {line[:60]!r}"
    return "it is not in the Prometheus text format"


# ---- what one engine's numbers obey --------------------------------------------------------------------
# A scrape (or a window of two) that breaks one of these rules is no single vLLM engine's: a proxy that merges
# several engines' /metrics, an exporter that rewrites them, a server that is not vLLM. Nothing read from it
# can be judged, so every reader refuses it whole rather than reporting a 5000% hit rate as healthy.

ONE_ENGINE = "these numbers cannot come from one vLLM engine"
# The exporters whose every metric counts something (tokens, requests, blocks, bytes, seconds) or is a share
# of it, so none is ever negative: vLLM's (0.32.0) and kvtune's router.
COUNTING_PREFIXES = ("vllm:", "kvtune_")
# Each counter and the counter it never exceeds (vLLM 0.32.0 counts a step's queried prompt tokens before the
# hits among them, so no scrape sees the hits ahead, and a window's hits never grow faster than its queries).
NEVER_ABOVE: dict[str, str] = {
    PREFIX_CACHE_HITS: PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS: EXTERNAL_PREFIX_CACHE_QUERIES,
}
# Gauges that are a share, 0-1 (vLLM 0.32.0 exports KV usage as a fraction, not a percent, despite its name).
FRACTIONS = (KV_CACHE_USAGE,)
# A window's figures from Prometheus are floating-point extrapolations, each series' alone: a rounding's
# worth past a bound is no impossibility there (a scrape's own numbers are exact, held to the bound exactly).
PROMETHEUS_ROUNDING = 1e-9
_SHOWN_LABELS = 160


def series(name: str, labels: Mapping[str, str]) -> str:
    """A series as an exposition writes it, for a message: label values escaped (no control character
    reaches the terminal), sorted, and cut short when long."""
    text = ",".join(f"{key}={json.dumps(value)}" for key, value in sorted(labels.items()))
    if len(text) > _SHOWN_LABELS:
        text = text[:_SHOWN_LABELS] + "..."
    return f"{name}{{{text}}}" if labels else name


def never_negative(name: str) -> bool:
    return name.startswith(COUNTING_PREFIXES) or name.endswith(("_bucket", "_count"))


def value_problem(name: str, shown: str, value: float) -> str:
    """Why one value of metric NAME (SHOWN as a series, or as a window's figure) cannot be an engine's
    ("" when it can): a count below zero, a share above one."""
    if value < 0 and never_negative(name):
        return f"{shown} = {value:g}: it counts, so it is never negative; {ONE_ENGINE}"
    if name in FRACTIONS and value > 1:
        return f"{shown} = {value:g}: it is a share, at most 1 (100%); {ONE_ENGINE}"
    return ""


def pair_problem(part: str, part_value: float, whole: str, whole_value: float, rounding: float = 0.0) -> str:
    """Why PART (shown) at PART_VALUE cannot sit beside WHOLE at WHOLE_VALUE ("" when it can), past a
    relative ROUNDING."""
    if part_value > whole_value + rounding * max(abs(whole_value), 1.0):
        return f"{part} = {part_value:,.6g} exceeds {whole} = {whole_value:,.6g}: {ONE_ENGINE}"
    return ""


def bucket_problem(counts: Mapping[float, float], rounding: float = 0.0) -> str:
    """Why cumulative bucket counts by upper bound cannot be a histogram's ("" when they can): a count below
    zero, or one below the count of a lower bound past a relative ROUNDING. (Counts without the +Inf bucket
    are incomplete, not impossible: `bucket_gap`.)"""
    below, lower = 0.0, None
    for bound in sorted(counts):
        count = counts[bound]
        if not math.isfinite(count) or count < 0:
            return f"has {count:g} observations up to le={bound:g}: no count is that"
        if lower is not None and count < below - rounding * max(below, 1.0):
            return (
                f"has {count:g} observations up to le={bound:g} but {below:g} up to le={lower:g}: buckets "
                "count every observation below their bound, so they never go down"
            )
        below, lower = count, bound
    return ""


def bucket_gap(counts: Mapping[float, float]) -> str:
    """Why cumulative bucket counts are incomplete ("" when they are not): observations without the +Inf
    bucket that holds them all."""
    if counts and math.inf not in counts and max(counts.values()) > 0:
        return "has no le=+Inf bucket: the count of all observations is missing"
    return ""


def impossible(samples: list[Sample], skipped: Collection[str] = ()) -> str:
    """Why these samples of one scrape cannot be one vLLM engine's, naming the series ("" when they can be):
    a series exported twice (a bucket's `le` compared as a number: "1" and "1.0" are one bucket), a count
    below zero, a share above one, hits above queries (per label set, and in all unless one of them had
    samples SKIPPED, by name), or a histogram whose buckets go down as their bound goes up."""
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    by_labels: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    totals: dict[str, float] = {}
    histograms: dict[tuple[str, frozenset[tuple[str, str]]], dict[float, float]] = {}
    for sample in samples:
        key = (sample.name, frozenset(_identity(sample.labels).items()))
        if key in seen:
            return f"{series(sample.name, sample.labels)} is exported twice in one scrape: {ONE_ENGINE}"
        seen.add(key)
        problem = value_problem(sample.name, series(sample.name, sample.labels), sample.value)
        if problem:
            return problem
        if sample.name in NEVER_ABOVE or sample.name in NEVER_ABOVE.values():
            by_labels[key] = sample.value
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        if sample.name.endswith("_bucket") and "le" in sample.labels:
            rest = frozenset((k, v) for k, v in sample.labels.items() if k != "le")
            bound = _bound(sample.labels["le"])
            if not math.isnan(bound):
                histograms.setdefault((sample.name, rest), {})[bound] = sample.value
    for (name, labels), value in by_labels.items():
        whole = NEVER_ABOVE.get(name)
        if whole is not None and (whole, labels) in by_labels:
            both = dict(labels)
            problem = pair_problem(series(name, both), value, series(whole, both), by_labels[(whole, labels)])
            if problem:
                return problem
    for part, whole in NEVER_ABOVE.items():
        if part in totals and whole in totals and not {part, whole} & set(skipped):
            problem = pair_problem(f"{part} in all", totals[part], f"{whole} in all", totals[whole])
            if problem:
                return problem
    for (name, labels), counts in histograms.items():
        problem = bucket_problem(counts)
        if problem:
            return f"{series(name, dict(labels))} {problem}; {ONE_ENGINE}"
    return ""


def _bound(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _identity(labels: Mapping[str, str]) -> dict[str, str]:
    """The labels that tell two series apart, a bucket's bound read as the number it is."""
    if "le" not in labels:
        return dict(labels)
    bound = _bound(labels["le"])
    return {**labels, "le": labels["le"] if math.isnan(bound) else repr(bound)}


def parse(text: str) -> list[Sample]:
    """The usable samples of a /metrics body (see read_exposition); ExpositionError when it is not one."""
    return read_exposition(text).samples


def scrape(url: str, client: httpx.Client | None = None) -> list[Sample]:
    """GET {url}/metrics (within kvtune's HTTP policy: a deadline and a size cap) and parse it."""
    if client is None:
        with http_client.new_client() as own:
            return scrape(url, own)
    response = http_client.get(client, f"{url}/metrics")
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


# Labels of `vllm:cache_config_info` that hold a count (vLLM 0.32.0 renders "None" for one left unset).
POOL_COUNT_LABELS = (
    "block_size",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
    "kv_cache_size_tokens",
    "kv_cache_memory_bytes",
)
_COUNT = re.compile(r"[0-9]{1,19}(\.0*)?")  # a whole number ("728", or "728.0"), below 10^19


def label_count(labels: Mapping[str, str], name: str) -> int | None:
    """A count label: None when absent or unset ("None"); ValueError naming it when it is anything else
    than a whole number ("inf", "-3", "1e9", "abc")."""
    value = labels.get(name, "").strip()
    if value in ("", "None"):
        return None
    if not _COUNT.fullmatch(value):
        raise ValueError(f"{CACHE_CONFIG_INFO}'s {name} is {value[:20]!r}, not a whole number")
    return int(value.split(".")[0])


def readable_cache_config(labels: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """The pool's labels without the count labels that hold no whole number, and why each was dropped."""
    readable, problems = dict(labels), []
    for name in POOL_COUNT_LABELS:
        try:
            label_count(labels, name)
        except ValueError as exc:
            problems.append(str(exc))
            del readable[name]
    return readable, problems


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
        """None when the engine reports no pool (or its block count unset); ValueError naming a label that
        should hold a whole number and does not."""
        return cls.from_labels(cache_config(samples))

    @classmethod
    def from_labels(cls, info: Mapping[str, str]) -> KvCapacity | None:
        blocks = label_count(info, "num_gpu_blocks")
        if blocks is None:
            return None
        block_size = label_count(info, "block_size")
        if not block_size:
            raise ValueError(
                f"{CACHE_CONFIG_INFO}'s block_size is {info.get('block_size')!r}: no pool has that"
            )
        tokens = label_count(info, "kv_cache_size_tokens") or blocks * block_size
        return cls(
            cache_dtype=info.get("cache_dtype", "auto"),
            block_size=block_size,
            num_blocks=blocks,
            tokens=tokens,
            prefix_caching=info.get("enable_prefix_caching", "").lower() == "true",
        )
