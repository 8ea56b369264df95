"""The PromQL kvtune's dashboards and alert rules share: one expression per fact, built on kvtune.metrics.

Counters are read through `rate()` over a window, never as lifetime ratios (a lifetime hit rate hides a
cache that stopped hitting an hour ago); ratios sum numerator and denominator over the same labels before
dividing, so an engine with no traffic yields no series rather than 0/0. Every query takes a Selector
(the label matchers: Grafana template variables on dashboards, none in alert rules) and a window
(`$__rate_interval` on dashboards, a fixed duration in rules).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtune import metrics

# The labels that tell engines apart: Prometheus' scrape target (`instance`) within a scrape job. vLLM's
# own `engine` label is the engine-core index inside one server, 0 for every server kvtune starts.
PER_ENGINE: tuple[str, ...] = ("job", "instance")
FLEET: tuple[str, ...] = ()
# vLLM's waiting reason for requests the KV pool or the batch limits have no room for.
WAITING_FOR_CAPACITY = 'reason="capacity"'


@dataclass(frozen=True)
class Selector:
    """Label matchers added to every metric a query reads, e.g. `job=~"$job"`."""

    matchers: tuple[str, ...] = ()

    def of(self, metric: str, *extra: str) -> str:
        matchers = (*self.matchers, *extra)
        return f"{metric}{{{', '.join(matchers)}}}" if matchers else metric


# Dashboards filter by template variables; `=~".*"` (the "All" value) also matches series without the
# label, so a Prometheus outside Kubernetes (no `namespace` label) shows data too.
DASHBOARD = Selector(
    ('namespace=~"$namespace"', 'job=~"$job"', 'model_name=~"$model"', 'instance=~"$engine"')
)
EVERYTHING = Selector()


def _by(labels: Sequence[str]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def summed_rate(metric: str, sel: Selector, window: str, by: Sequence[str] = FLEET, *extra: str) -> str:
    return f"sum{_by(by)} (rate({sel.of(metric, *extra)}[{window}]))"


def prefix_cache_hit_rate(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Share of queried prompt tokens found in the prefix cache over the window, 0-1."""
    hits = summed_rate(metrics.PREFIX_CACHE_HITS, sel, window, by)
    queries = summed_rate(metrics.PREFIX_CACHE_QUERIES, sel, window, by)
    return f"{hits}\n/\n{queries}"


def prefix_cache_queries_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Prompt tokens looked up in the prefix cache per second: the traffic a hit rate is made of."""
    return summed_rate(metrics.PREFIX_CACHE_QUERIES, sel, window, by)


def cached_prompt_tokens_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    return summed_rate(metrics.PROMPT_TOKENS_CACHED, sel, window, by)


def preemptions_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Requests evicted from the KV pool per second; each one is prefilled again later."""
    return summed_rate(metrics.PREEMPTIONS, sel, window, by)


def preemptions_in(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Preemptions counted over the whole window (alerts: any at all, not a per-second average)."""
    return f"sum{_by(by)} (increase({sel.of(metrics.PREEMPTIONS)}[{window}]))"


def kv_cache_usage(sel: Selector, by: Sequence[str] = PER_ENGINE) -> str:
    """Share of the KV pool's blocks in use, 0-1."""
    return f"max{_by(by)} ({sel.of(metrics.KV_CACHE_USAGE)})"


def requests_running(sel: Selector, by: Sequence[str] = PER_ENGINE) -> str:
    return f"sum{_by(by)} ({sel.of(metrics.REQUESTS_RUNNING)})"


def requests_waiting(sel: Selector, by: Sequence[str] = PER_ENGINE) -> str:
    return f"sum{_by(by)} ({sel.of(metrics.REQUESTS_WAITING)})"


def requests_waiting_by_reason(sel: Selector, by: Sequence[str] = PER_ENGINE) -> str:
    """Waiting requests split by vLLM's reason: `capacity` (no KV or batch room) or `deferred`."""
    return f"sum{_by((*by, 'reason'))} ({sel.of(metrics.REQUESTS_WAITING_BY_REASON)})"


def requests_waiting_for_capacity(sel: Selector, by: Sequence[str] = PER_ENGINE) -> str:
    return f"sum{_by(by)} ({sel.of(metrics.REQUESTS_WAITING_BY_REASON, WAITING_FOR_CAPACITY)})"


def latency_quantile(
    histogram: str, quantile: float, sel: Selector, window: str, by: Sequence[str] = PER_ENGINE
) -> str:
    """A quantile of one of vLLM's latency histograms (base name, seconds) over the window."""
    buckets = summed_rate(f"{histogram}_bucket", sel, window, (*by, "le"))
    return f"histogram_quantile({quantile:g}, {buckets})"


def latency_observations_per_s(
    histogram: str, sel: Selector, window: str, by: Sequence[str] = PER_ENGINE
) -> str:
    """Observations per second of a latency histogram (TTFT: requests given their first token): the
    traffic its quantiles are made of."""
    return summed_rate(f"{histogram}_count", sel, window, by)


def requests_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Finished requests per second, whatever their finish reason."""
    return summed_rate(metrics.REQUEST_SUCCESS, sel, window, by)


def prompt_tokens_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    return summed_rate(metrics.PROMPT_TOKENS, sel, window, by)


def generation_tokens_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    return summed_rate(metrics.GENERATION_TOKENS, sel, window, by)


def histogram_observations_in(
    histogram: str, sel: Selector, window: str, by: Sequence[str] = PER_ENGINE
) -> str:
    """Observations a histogram counted over the whole window (alerts: enough of them to judge)."""
    return f"sum{_by(by)} (increase({sel.of(f'{histogram}_count')}[{window}]))"


# ---- KV block residency (vLLM's --kv-cache-metrics) and the KV connector's tiers ----------------------


def block_residency_quantile(
    histogram: str, quantile: float, sel: Selector, window: str, by: Sequence[str] = PER_ENGINE
) -> str:
    """A quantile of one of vLLM's block residency histograms (metrics.BLOCK_RESIDENCY, seconds) over the
    window: of the sampled blocks evicted in it, their idle time before eviction, lifetime or reuse gaps."""
    return latency_quantile(histogram, quantile, sel, window, by)


def blocks_evicted_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Sampled KV blocks handed out again (evicted) per second: one idle-before-eviction observation each."""
    return summed_rate(f"{metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS}_count", sel, window, by)


def reuse_gaps_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Reuse gaps of sampled blocks counted per second (at the blocks' eviction, up to three a block)."""
    return summed_rate(f"{metrics.KV_BLOCK_REUSE_GAP_SECONDS}_count", sel, window, by)


def prompt_tokens_by_source_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Prompt tokens per second by where their KV came from: computed here, this engine's prefix cache, or
    a KV connector (the offload tier, another instance)."""
    return summed_rate(metrics.PROMPT_TOKENS_BY_SOURCE, sel, window, (*by, "source"))


def cached_prompt_tokens_by_tier_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Cached prompt tokens per second by the tier that held them: device, host (the offload tier), disk,
    p2p, external_unspecified."""
    return summed_rate(metrics.PROMPT_TOKENS_CACHED_BY_SOURCE, sel, window, (*by, "source"))


def external_prefix_cache_hit_rate(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> str:
    """Share of the prompt tokens looked up in the KV connector's cache (the offload tier) found there, 0-1;
    no series while nothing is looked up there."""
    hits = summed_rate(metrics.EXTERNAL_PREFIX_CACHE_HITS, sel, window, by)
    queries = summed_rate(metrics.EXTERNAL_PREFIX_CACHE_QUERIES, sel, window, by)
    return f"{hits}\n/\n({queries} > 0)"


def kv_offload_bytes_per_s(sel: Selector, window: str, by: Sequence[str] = PER_ENGINE) -> tuple[str, str]:
    """Bytes per second the offload tier stores (accelerator to host memory) and loads back."""
    return (
        summed_rate(metrics.KV_OFFLOAD_STORE_BYTES, sel, window, by),
        summed_rate(metrics.KV_OFFLOAD_LOAD_BYTES, sel, window, by),
    )


def cache_config_info(sel: Selector) -> str:
    """One series per engine whose labels are its real KV pool: dtype, block size, blocks, tokens."""
    return sel.of(metrics.CACHE_CONFIG_INFO)


# ---- kvtune's router -----------------------------------------------------------------------------------

# Router metrics carry no vLLM labels (model, engine instance): its panels filter by namespace and job.
ROUTER_LABELS = ('namespace=~"$namespace"', 'job=~"$job"')


def routed_per_s(sel: Selector, window: str) -> str:
    """Requests the router sent each engine per second, by the reason the policy gave."""
    return summed_rate(metrics.ROUTER_REQUESTS, sel, window, ("engine", "reason"))


def routed_per_worker_per_s(sel: Selector, window: str) -> str:
    """Requests each router worker routed per second (`worker`: the scrape label of `--router-workers`)."""
    return summed_rate(metrics.ROUTER_REQUESTS, sel, window, ("worker",))


def router_overhead_quantile(quantile: float, sel: Selector, window: str) -> str:
    """The router's own time per request (arrival to upstream call sent), at a quantile."""
    return latency_quantile(metrics.ROUTER_OVERHEAD_SECONDS, quantile, sel, window, FLEET)


def router_failures_per_s(sel: Selector, window: str) -> tuple[str, str, str]:
    """Upstream errors by engine and kind, refusals by reason, KV-event resyncs by engine and cause."""
    return (
        summed_rate(metrics.ROUTER_UPSTREAM_ERRORS, sel, window, ("engine", "kind")),
        summed_rate(metrics.ROUTER_REFUSED, sel, window, ("reason",)),
        summed_rate(metrics.ROUTER_KV_EVENTS_RESYNCS, sel, window, ("engine", "cause")),
    )


def matched_prefix_blocks_mean(sel: Selector, window: str) -> str:
    """Mean prefix blocks the chosen engine was judged to hold, per routed request."""
    total = summed_rate(f"{metrics.ROUTER_MATCHED_BLOCKS}_sum", sel, window)
    count = summed_rate(f"{metrics.ROUTER_MATCHED_BLOCKS}_count", sel, window)
    return f"{total}\n/\n{count}"
