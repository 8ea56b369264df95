"""Grafana dashboards for vLLM engines, built with Grafana's own SDK from the shared PromQL in promql.py.

`make generate` (tools/generate.py) renders them to `dashboards/*.json` and the README's panel tables; a
test runs its `--check`, so the committed copies cannot drift. Users build or push them with `kvtune
dashboards build|push`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.builder import Builder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, units
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from kvtune import metrics, metrics_window
from kvtune.observability import alerts, promql
from kvtune.observability.promql import DASHBOARD, FLEET, PER_ENGINE

PROMETHEUS = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Grafana's own annotation store, where the sweep posts one annotation per trial.
GRAFANA_ANNOTATIONS = model.DataSourceRef(type_val="grafana", uid="-- Grafana --")
SWEEP_ANNOTATION_TAGS = ("kvtune", "sweep")
WINDOW = "$__rate_interval"
# The dashboard's whole time range: a stat summarises what the graphs beside it show.
RANGE = "$__range"
# What dashboard_targets() puts in place of Grafana's variables so Prometheus can evaluate a query as is.
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__range": "5m"}

TOKENS_PER_S = "suffix: tok/s"
PER_S = "suffix:/s"
# (value, colour) steps: a colour applies from its value up; None is the base. Red starts where the alert
# rules fire; the other step is a warning margin shown only on the dashboards.
Steps = tuple[tuple[float | None, str], ...]
HIT_RATE_GOOD = alerts.PREFIX_CACHE_HIT_RATE_HEALTHY
KV_USAGE_HIGH = 0.9
HIT_RATE_STEPS: Steps = (
    (None, "red"),
    (alerts.PREFIX_CACHE_HIT_RATE_MIN, "yellow"),
    (HIT_RATE_GOOD, "green"),
)
KV_USAGE_STEPS: Steps = ((None, "green"), (KV_USAGE_HIGH, "yellow"), (alerts.KV_CACHE_USAGE_MAX, "red"))
QUANTILES = (0.5, 0.95, 0.99)

# Each dashboard filter is a Grafana variable named in promql.DASHBOARD's matchers, `label=~"$variable"`.
_VARIABLE_MATCHER = re.compile(r'(?P<label>\w+)=~"\$(?P<variable>\w+)"')
_VARIABLE_HELP = {
    "namespace": "Kubernetes namespace (series without one, outside Kubernetes, match All).",
    "job": "Prometheus scrape job.",
    "model": "Served model name (vLLM's model_name label).",
    "engine": "One vLLM server: Prometheus' scrape target (instance label).",
}
# vLLM puts no model label on cache_config_info: the capacity table keeps every filter but the model's.
ENGINE_INFO = promql.Selector(tuple(m for m in DASHBOARD.matchers if not m.startswith("model_name=")))
# The cache_config_info labels the capacity table shows, in order, and their headers. vLLM 0.32.0 turns
# every CacheConfig field into a label (`CacheConfig.metrics_info()`).
CACHE_CONFIG_COLUMNS = {
    "job": "Job",
    "instance": "Engine",
    "cache_dtype": "KV dtype",
    "block_size": "Block size (tokens)",
    "num_gpu_blocks": "KV blocks",
    "kv_cache_size_tokens": "KV capacity (tokens)",
    "enable_prefix_caching": "Prefix caching",
    "gpu_memory_utilization": "Memory share",
    "kv_cache_memory_bytes": "KV budget (bytes)",
}

# Panel descriptions: what the panel shows, what a bad value means, and the profile field to change.
HIT_RATE_HELP = (
    "Share of queried prompt tokens served from the prefix cache, per engine and for the fleet. "
    "Below 90% (red) with shared prefixes in the traffic: they are evicted before reuse. Raise the KV "
    "budget (kv_cache_memory_bytes or gpu_memory_utilization) or use an fp8 KV cache (kv_cache_dtype: fp8, "
    "twice the tokens per byte); check enable_prefix_caching is on in the table below."
)
FLEET_HIT_RATE_HELP = (
    "Prefix-cache hit rate of all selected engines over the dashboard's time range. Red below 90%: shared "
    "prefixes are evicted before reuse; raise kv_cache_memory_bytes or gpu_memory_utilization, or use "
    "kv_cache_dtype: fp8."
)
CACHED_TOKENS_HELP = (
    "Prompt tokens per second served from the prefix cache, against those looked up in it. A wide gap "
    "on traffic with shared system prompts or documents means the cache does not keep them: raise "
    "kv_cache_memory_bytes or gpu_memory_utilization, or use kv_cache_dtype: fp8; warm the shared "
    "prefixes with the profile's warmup list."
)
PREEMPTIONS_HELP = (
    "Requests evicted from the KV pool per second; each is prefilled again later, costing TTFT and "
    "throughput. Any sustained value: the KV pool is too small for the running batch. Raise "
    "kv_cache_memory_bytes or gpu_memory_utilization, use kv_cache_dtype: fp8, or lower max_num_seqs."
)
KV_USAGE_HELP = (
    "Share of each engine's KV pool blocks in use. Above 90% (yellow) new "
    "requests start to wait for blocks; above 95% (red) expect preemptions. Raise kv_cache_memory_bytes "
    "or gpu_memory_utilization, use kv_cache_dtype: fp8, or lower max_num_seqs."
)
WAITING_BY_REASON_HELP = (
    "Queued requests by vLLM's reason. 'capacity': no room in the KV pool or the batch; raise "
    "kv_cache_memory_bytes or gpu_memory_utilization, use kv_cache_dtype: fp8, or raise max_num_seqs if "
    "KV usage is low. 'deferred': held back by a transient constraint (LoRA budget, KV transfer, a "
    "blocked request); not a KV pool size problem."
)
CAPACITY_HELP = (
    "The KV pool each engine really allocated (vLLM's cache_config_info): dtype, block size, blocks and "
    "tokens, prefix caching, and the memory settings that sized it. Fewer tokens than your longest "
    "prompts times the batch you expect: raise kv_cache_memory_bytes or gpu_memory_utilization, or use "
    "kv_cache_dtype: fp8. vLLM puts no model label on this series, so the model filter does not apply."
)
RESIDENCY_HELP = (
    "Of the sampled KV blocks evicted, the median time they sat idle before eviction (how long an unused "
    "block survives: the eviction horizon) against the gaps between their prefix-cache hits. vLLM records "
    "a gap only for a block that survived it, so the gaps stop near the horizon; the p90 gap at or above "
    "the median idle time means reuse runs into eviction and the reuses a little later are prefilled "
    "again. Grow the pool (kv_cache_memory_bytes, gpu_memory_utilization or num_gpu_blocks_override); "
    "kvtune doctor gives the size. No data: the engine runs without kv_cache_metrics."
)
LIFETIME_HELP = (
    "Of the sampled KV blocks evicted, the time from allocation to eviction. Short lifetimes with a low hit "
    "rate: the pool turns over faster than prompts come back; raise kv_cache_memory_bytes or "
    "gpu_memory_utilization, or use kv_cache_dtype: fp8. No data: set kv_cache_metrics: true."
)
EVICTIONS_HELP = (
    "Sampled KV blocks evicted per second, and reuse gaps counted (at eviction, up to three a block): "
    "kv_cache_metrics_sample of every block (vLLM's default 1%; the CPU profile follows all). Evictions "
    "with no reuse on traffic that shares prefixes: they are evicted before their first hit; raise "
    "kv_cache_memory_bytes or gpu_memory_utilization."
)
SOURCES_HELP = (
    "Prompt tokens per second by where their KV came from: local_compute (prefilled here), local_cache_hit "
    "(this engine's prefix cache) or external_kv_transfer (a KV connector: the offload tier of "
    "kv_offloading_size, another instance). local_compute growing on traffic that shares prefixes: the "
    "pool is too small; raise kv_cache_memory_bytes or gpu_memory_utilization, or on a GPU set "
    "kv_offloading_size."
)
TIERS_HELP = (
    "Cached prompt tokens per second by the tier that held them: device (the KV pool), host (the offload "
    "tier of kv_offloading_size in host memory), disk, p2p. Host hits growing: the pool evicts what the "
    "tier then serves; raising kv_cache_memory_bytes or gpu_memory_utilization keeps them on the device."
)
EXTERNAL_HIT_RATE_HELP = (
    "Share of the prompt tokens looked up in the KV connector's cache (the offload tier of "
    "kv_offloading_size) found there. Low while the device hit rate is low too: the tier is too small for "
    "the traffic's reuse; raise kv_offloading_size. No data: no connector, or nothing looked up yet."
)
OFFLOAD_HELP = (
    "Bytes per second the offload tier stores (device to host memory) and loads back (a hit there). "
    "Stores with hardly any loads: what is offloaded is not asked for again; lower kv_offloading_size or "
    "remove it. GPU builds only (kv_offloading_size); a series appears at the tier's first transfer."
)
LATENCY_HELP = {
    "TTFT": (
        "Time to first token: queueing plus prefill. High with a long queue time: the engine is "
        "saturated; add engines or lower the request rate. High with a short queue time: long prefills; "
        "lower max_num_batched_tokens for steadier steps or raise the prefix-cache hit rate."
    ),
    "ITL": (
        "Time between streamed tokens: one decode step. High: the batch is too wide or prefills "
        "interrupt decodes; lower max_num_seqs or max_num_batched_tokens (smaller prefill chunks)."
    ),
    "E2E": (
        "Arrival to last token. High with normal TTFT and ITL: long outputs (cap them with the "
        "request's max_tokens). High with high ITL: lower max_num_seqs; with high TTFT: see the TTFT "
        "and queue time panels."
    ),
    "Queue time": (
        "Arrival to first scheduled. Above zero for long: no KV or batch room; see waiting requests. "
        "Raise kv_cache_memory_bytes or gpu_memory_utilization, use kv_cache_dtype: fp8, raise "
        "max_num_seqs if KV usage is low, or add engines."
    ),
}
RUNNING_WAITING_HELP = (
    "Requests in the running batch and in the queue. Waiting above zero for long: the engine has no KV "
    "or batch room; raise kv_cache_memory_bytes or gpu_memory_utilization, use kv_cache_dtype: fp8, "
    "raise max_num_seqs if KV usage is low, or add engines."
)
REQUEST_RATE_HELP = (
    "Finished requests per second, whatever their finish reason. Flat while waiting requests grow: the "
    "engine is at capacity. With high KV usage or preemptions, raise kv_cache_memory_bytes or "
    "gpu_memory_utilization (or use kv_cache_dtype: fp8); with KV room left, raise max_num_seqs."
)
THROUGHPUT_HELP = (
    "Prompt and generation tokens per second. Generation throughput falling while running requests stay "
    "high: decode steps slowed; lower max_num_seqs or max_num_batched_tokens."
)


def _thresholds(steps: Steps) -> dashboard.ThresholdsConfig:
    return (
        dashboard.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps([model.Threshold(value=value, color=color) for value, color in steps])
    )


def _target(ref: int, expr: str, legend: str | None = None) -> prometheus.Dataquery:
    query = prometheus.Dataquery().ref_id(chr(ord("A") + ref)).expr(expr)
    return query.legend_format(legend) if legend is not None else query


def _timeseries(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[tuple[str, str]],
    *,
    steps: Steps | None = None,
    fraction: bool = False,
    width: int = 12,
) -> timeseries.Panel:
    """A graph of (legend, expr) queries; `fraction` pins the axis to 0-1, `steps` draws dashed lines."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(PROMETHEUS)
        .unit(unit)
        .span(width)
        .height(8)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    for ref, (legend, expr) in enumerate(queries):
        panel.with_target(_target(ref, expr, legend))
    if fraction:
        panel.min(0).max(1)
    if steps is not None:
        panel.thresholds(_thresholds(steps)).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED)
        )
    return panel


def _hit_rate_panel(width: int = 16) -> timeseries.Panel:
    return _timeseries(
        "Prefix-cache hit rate",
        HIT_RATE_HELP,
        units.PercentUnit,
        [
            ("{{instance}}", promql.prefix_cache_hit_rate(DASHBOARD, WINDOW, PER_ENGINE)),
            ("fleet", promql.prefix_cache_hit_rate(DASHBOARD, WINDOW, FLEET)),
        ],
        steps=HIT_RATE_STEPS,
        fraction=True,
        width=width,
    )


def _fleet_hit_rate_stat() -> stat.Panel:
    return (
        stat.Panel()
        .title("Fleet prefix-cache hit rate")
        .description(FLEET_HIT_RATE_HELP)
        .datasource(PROMETHEUS)
        .with_target(_target(0, promql.prefix_cache_hit_rate(DASHBOARD, RANGE, FLEET)).instant())
        .unit(units.PercentUnit)
        .min(0)
        .max(1)
        .decimals(1)
        .thresholds(_thresholds(HIT_RATE_STEPS))
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .graph_mode(common.BigValueGraphMode.NONE)
        .text_mode(common.BigValueTextMode.VALUE)
        .span(8)
        .height(8)
    )


def _cached_tokens_panel() -> timeseries.Panel:
    return _timeseries(
        "Cached prompt tokens/s",
        CACHED_TOKENS_HELP,
        TOKENS_PER_S,
        [
            ("{{instance}} cached", promql.cached_prompt_tokens_per_s(DASHBOARD, WINDOW)),
            ("{{instance}} looked up", promql.prefix_cache_queries_per_s(DASHBOARD, WINDOW)),
        ],
        width=24,
    )


def _preemptions_panel(width: int = 12) -> timeseries.Panel:
    return _timeseries(
        "Preemptions/s",
        PREEMPTIONS_HELP,
        PER_S,
        [("{{instance}}", promql.preemptions_per_s(DASHBOARD, WINDOW))],
        width=width,
    )


def _kv_usage_panel(width: int = 12) -> timeseries.Panel:
    return _timeseries(
        "KV cache usage",
        KV_USAGE_HELP,
        units.PercentUnit,
        [("{{instance}}", promql.kv_cache_usage(DASHBOARD))],
        steps=KV_USAGE_STEPS,
        fraction=True,
        width=width,
    )


def _waiting_by_reason_panel() -> timeseries.Panel:
    return _timeseries(
        "Requests waiting by reason",
        WAITING_BY_REASON_HELP,
        units.Short,
        [("{{instance}} {{reason}}", promql.requests_waiting_by_reason(DASHBOARD))],
        width=8,
    )


def _capacity_table() -> table.Panel:
    columns = list(CACHE_CONFIG_COLUMNS)
    return (
        table.Panel()
        .title("KV capacity and cache config per engine")
        .description(CAPACITY_HELP)
        .datasource(PROMETHEUS)
        .with_target(
            _target(0, promql.cache_config_info(ENGINE_INFO)).instant().format(PromQueryFormat.TABLE)
        )
        .with_transformation(
            model.DataTransformerConfig(id_val="filterFieldsByName", options={"include": {"names": columns}})
        )
        .with_transformation(
            model.DataTransformerConfig(
                id_val="organize",
                options={
                    "indexByName": {name: index for index, name in enumerate(columns)},
                    "renameByName": dict(CACHE_CONFIG_COLUMNS),
                },
            )
        )
        .show_header(True)
        .span(24)
        .height(7)
    )


def _residency_panels() -> list[timeseries.Panel]:
    idle, lifetime = metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS, metrics.KV_BLOCK_LIFETIME_SECONDS
    gaps = metrics.KV_BLOCK_REUSE_GAP_SECONDS
    idle_q, gap_q = metrics_window.IDLE_QUANTILE, metrics_window.REUSE_GAP_QUANTILE

    def quantile(histogram: str, q: float) -> str:
        return promql.block_residency_quantile(histogram, q, DASHBOARD, WINDOW)

    return [
        _timeseries("Reuse gap vs idle before eviction", RESIDENCY_HELP, units.Seconds,
                    [(f"p{idle_q * 100:g} idle before eviction {{{{instance}}}}", quantile(idle, idle_q)),
                     (f"p{gap_q * 100:g} reuse gap {{{{instance}}}}", quantile(gaps, gap_q)),
                     ("p50 reuse gap {{instance}}", quantile(gaps, 0.5))], width=8),
        _timeseries("Block lifetime p50/p90", LIFETIME_HELP, units.Seconds,
                    [(f"p{q * 100:g} {{{{instance}}}}", quantile(lifetime, q)) for q in (0.5, 0.9)], width=8),
        _timeseries("Blocks evicted and reuse gaps/s (sampled)", EVICTIONS_HELP, PER_S,
                    [("{{instance}} evicted", promql.blocks_evicted_per_s(DASHBOARD, WINDOW)),
                     ("{{instance}} reuse gaps", promql.reuse_gaps_per_s(DASHBOARD, WINDOW))], width=8),
    ]  # fmt: skip


def _source_and_offload_panels() -> list[timeseries.Panel]:
    stored, loaded = promql.kv_offload_bytes_per_s(DASHBOARD, WINDOW)
    return [
        _timeseries("Prompt tokens by source", SOURCES_HELP, TOKENS_PER_S,
                    [("{{instance}} {{source}}", promql.prompt_tokens_by_source_per_s(DASHBOARD, WINDOW))],
                    width=6),
        _timeseries("Cached prompt tokens by tier", TIERS_HELP, TOKENS_PER_S,
                    [("{{instance}} {{source}}",
                      promql.cached_prompt_tokens_by_tier_per_s(DASHBOARD, WINDOW))], width=6),
        _timeseries("External prefix-cache hit rate", EXTERNAL_HIT_RATE_HELP, units.PercentUnit,
                    [("{{instance}}", promql.external_prefix_cache_hit_rate(DASHBOARD, WINDOW))],
                    fraction=True, width=6),
        _timeseries("KV offload traffic", OFFLOAD_HELP, units.BytesPerSecondSI,
                    [("{{instance}} stored", stored), ("{{instance}} loaded", loaded)], width=6),
    ]  # fmt: skip


def _latency_panel(
    name: str, histogram: str, quantiles: Sequence[float], width: int = 12
) -> timeseries.Panel:
    queries = [
        (
            f"p{quantile * 100:g} {{{{instance}}}}",
            promql.latency_quantile(histogram, quantile, DASHBOARD, WINDOW),
        )
        for quantile in quantiles
    ]
    title = f"{name} " + "/".join(f"p{q * 100:g}" for q in quantiles)
    return _timeseries(title, LATENCY_HELP[name], units.Seconds, queries, width=width)


def _running_waiting_panel() -> timeseries.Panel:
    return _timeseries(
        "Running and waiting requests",
        RUNNING_WAITING_HELP,
        units.Short,
        [
            ("{{instance}} running", promql.requests_running(DASHBOARD)),
            ("{{instance}} waiting", promql.requests_waiting(DASHBOARD)),
        ],
        width=8,
    )


def _request_rate_panel(width: int = 8) -> timeseries.Panel:
    return _timeseries(
        "Request throughput",
        REQUEST_RATE_HELP,
        units.RequestsPerSecond,
        [("{{instance}}", promql.requests_per_s(DASHBOARD, WINDOW))],
        width=width,
    )


def _token_rate_panel() -> timeseries.Panel:
    return _timeseries(
        "Token throughput",
        THROUGHPUT_HELP,
        TOKENS_PER_S,
        [
            ("{{instance}} prompt", promql.prompt_tokens_per_s(DASHBOARD, WINDOW)),
            ("{{instance}} generation", promql.generation_tokens_per_s(DASHBOARD, WINDOW)),
        ],
        width=8,
    )


ROUTER = promql.Selector(promql.ROUTER_LABELS)
ROUTED_HELP = (
    "Requests kvtune's router sent each engine per second, by why the policy chose it: prefix_match / "
    "kv_events_match (a shared prefix decided), no_prefix_match, over_load_bound (a hot prefix spilled to "
    "a less loaded engine), kv_events_stale (an engine's KV events had a gap; judged by what was sent), "
    "round_robin, least_loaded, session. Few matches on a workload with shared prefixes: check the "
    "engines' block_size and that they publish KV events (kv_events_port)."
)
ROUTER_OVERHEAD_HELP = (
    "The router's own time per request, from arrival to the upstream call being sent: reading the body, "
    "tokenising the prompt, hashing its blocks, choosing. Tokenising grows with the prompt; beside the "
    "prefill a shared prefix saves each of the replicas, it is small."
)
ROUTER_FAILURES_HELP = (
    "Upstream errors (connect: the engine refused and the request was retried elsewhere; timeout; broken "
    "answers), requests refused before any engine saw them (not JSON, unknown model, too long, API key), "
    "and KV-event resyncs (the router's view of an engine's cache went stale: events lost between the "
    "engine and the router's kv_events_port)."
)
WORKERS_HELP = (
    "Requests each router worker routed per second (`kvtune up --router-workers N`: the kernel spreads "
    "connections over the workers; one series when the router runs as one process). A worker at zero while "
    "the others serve has died and is being started again (control API: /router/workers). Every worker hears "
    "every engine's KV events (kv_events_port); without them (the prefix policy) each knows only its own "
    "share, so more workers mean fewer prefix matches. The panels beside this one sum the workers."
)
MATCHED_BLOCKS_HELP = (
    "Mean prefix blocks the chosen engine held for each routed request: the prefill the routing saved, "
    "in KV blocks (times block_size for tokens)."
)


def _router_panels() -> list[timeseries.Panel]:
    upstream, refused, resyncs = promql.router_failures_per_s(ROUTER, WINDOW)
    return [
        _timeseries("Routed requests by decision", ROUTED_HELP, units.RequestsPerSecond,
                    [("{{engine}} {{reason}}", promql.routed_per_s(ROUTER, WINDOW))], width=12),
        _timeseries("Matched prefix blocks per request", MATCHED_BLOCKS_HELP, units.Short,
                    [("mean", promql.matched_prefix_blocks_mean(ROUTER, WINDOW))], width=12),
        _timeseries("Router overhead p50/p99", ROUTER_OVERHEAD_HELP, units.Seconds,
                    [(f"p{q * 100:g}", promql.router_overhead_quantile(q, ROUTER, WINDOW))
                     for q in (0.5, 0.99)], width=12),
        _timeseries("Router errors, refusals and KV-event resyncs", ROUTER_FAILURES_HELP, units.Short,
                    [("{{engine}} {{kind}}", upstream), ("refused {{reason}}", refused),
                     ("resync {{engine}} {{cause}}", resyncs)], width=12),
        _timeseries("Requests per router worker", WORKERS_HELP, units.RequestsPerSecond,
                    [("worker {{worker}}", promql.routed_per_worker_per_s(ROUTER, WINDOW))], width=24),
    ]  # fmt: skip


def _template_variables() -> list[Builder[model.VariableModel]]:
    """Data source, then one multi-select filter per promql.DASHBOARD matcher, each narrowed by the ones
    before it and listing the label's values on a gauge every vLLM server exports."""
    variables: list[Builder[model.VariableModel]] = [
        dashboard.DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")
    ]
    narrowed: list[str] = []
    for matcher in DASHBOARD.matchers:
        found = _VARIABLE_MATCHER.fullmatch(matcher)
        if found is None:
            raise ValueError(f'promql.DASHBOARD matcher {matcher!r} is not of the form label=~"$variable"')
        label, name = found["label"], found["variable"]
        values = promql.Selector(tuple(narrowed)).of(metrics.REQUESTS_RUNNING)
        variables.append(
            dashboard.QueryVariable(name)
            .id(name)
            .label(name.capitalize())
            .description(_VARIABLE_HELP[name])
            .datasource(PROMETHEUS)
            .query(f"label_values({values}, {label})")
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(model.VariableSort.ALPHABETICAL_ASC)
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .current(model.VariableOption(text=["All"], value=["$__all"]))
        )
        narrowed.append(matcher)
    return variables


def _dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["kvtune", "vllm"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .variables(_template_variables())
    )


def _kv_cache() -> dashboard.Dashboard:
    built = (
        _dashboard(
            "kvtune-kv-cache",
            "kvtune / KV cache",
            "Is the KV pool big enough and does the prefix cache hit: hit rate, cached tokens, usage, "
            "preemptions, queueing for capacity, each engine's real KV capacity, how long blocks stay cached "
            "against how long reuses wait, and where prompt tokens' KV came from (the offload tier).",
        )
        .with_row(dashboard.Row("Prefix cache"))
        .with_panel(_hit_rate_panel())
        .with_panel(_fleet_hit_rate_stat())
        .with_panel(_cached_tokens_panel())
        .with_row(dashboard.Row("KV pool"))
        .with_panel(_kv_usage_panel(width=8))
        .with_panel(_preemptions_panel(width=8))
        .with_panel(_waiting_by_reason_panel())
        .with_panel(_capacity_table())
        .with_row(dashboard.Row("Block residency (kv_cache_metrics)"))
    )
    for panel in _residency_panels():
        built = built.with_panel(panel)
    built = built.with_row(dashboard.Row("Prompt sources and the KV offload tier"))
    for panel in _source_and_offload_panels():
        built = built.with_panel(panel)
    return built


def _latency_and_load() -> dashboard.Dashboard:
    built = (
        _dashboard(
            "kvtune-latency-load",
            "kvtune / Latency and load",
            "What users see and what the engines carry: TTFT, ITL, end-to-end and queue time at "
            "p50/p95/p99, the batch and the queue, request and token throughput.",
        )
        .with_row(dashboard.Row("Latency"))
        .with_panel(_latency_panel("TTFT", metrics.TTFT_SECONDS, QUANTILES))
        .with_panel(_latency_panel("ITL", metrics.ITL_SECONDS, QUANTILES))
        .with_panel(_latency_panel("E2E", metrics.E2E_SECONDS, QUANTILES))
        .with_panel(_latency_panel("Queue time", metrics.QUEUE_TIME_SECONDS, QUANTILES))
        .with_row(dashboard.Row("Load"))
        .with_panel(_running_waiting_panel())
        .with_panel(_request_rate_panel())
        .with_panel(_token_rate_panel())
        .with_row(dashboard.Row("Router fleet (kvtune up with several engines)"))
    )
    for panel in _router_panels():
        built = built.with_panel(panel)
    return built


def _sweep() -> dashboard.Dashboard:
    trials = (
        dashboard.AnnotationQuery()
        .name("Sweep trials")
        .datasource(GRAFANA_ANNOTATIONS)
        .enable(True)
        .icon_color("purple")
        .target(
            dashboard.AnnotationTarget()
            .type("tags")
            .tags(list(SWEEP_ANNOTATION_TAGS))
            .match_any(False)
            .limit(1000)
        )
    )
    return (
        _dashboard(
            "kvtune-sweep",
            "kvtune / Sweep",
            "A tuning sweep's trials as annotations (tags kvtune and sweep, one per trial, with its config "
            "and outcome) over the signals goodput depends on: request rate, tail latency, KV usage, "
            "preemptions and the prefix-cache hit rate.",
        )
        .time("now-6h", "now")
        .annotation(trials)
        .with_panel(_request_rate_panel(width=12))
        .with_panel(_latency_panel("TTFT", metrics.TTFT_SECONDS, (0.99,)))
        .with_panel(_latency_panel("ITL", metrics.ITL_SECONDS, (0.99,)))
        .with_panel(_kv_usage_panel())
        .with_panel(_preemptions_panel())
        .with_panel(_hit_rate_panel(width=12))
    )


def _panels(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of a dashboard model, rows and the panels of collapsed rows included."""
    for panel in data.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def _model(builder: dashboard.Dashboard) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    # Grafana wants panel ids unique within a dashboard; the SDK leaves them to the caller.
    for number, panel in enumerate(_panels(data), start=1):
        panel["id"] = number
    return data


def all_dashboards() -> dict[str, dict[str, Any]]:
    """File stem -> dashboard JSON model, as Grafana's API takes it under "dashboard"."""
    return {
        "kvtune-kv-cache": _model(_kv_cache()),
        "kvtune-latency-load": _model(_latency_and_load()),
        "kvtune-sweep": _model(_sweep()),
    }


def render(data: dict[str, Any]) -> str:
    """A dashboard model as committed: indent 2, sorted keys, trailing newline."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_dashboards(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, data in all_dashboards().items():
        path = directory / f"{stem}.json"
        path.write_text(render(data), encoding="utf-8")
        written.append(path)
    return written


def evaluable(expr: str) -> str:
    """EXPR with Grafana's variables replaced so Prometheus evaluates it directly (filters become All)."""
    for variable, value in SUBSTITUTIONS.items():
        expr = expr.replace(variable, value)
    return _VARIABLE_MATCHER.sub(lambda found: f'{found["label"]}=~".*"', expr)


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(dashboard title, panel title, evaluable PromQL) for every query of every dashboard."""
    return [
        (data["title"], panel["title"], evaluable(target["expr"]))
        for data in all_dashboards().values()
        for panel in _panels(data)
        for target in panel.get("targets", [])
    ]


def _code(text: str) -> str:
    """TEXT as a code span inside a Markdown table cell: one line, pipes escaped."""
    if "`" in text:
        raise ValueError(f"a backtick cannot sit in a table code span: {text!r}")
    return "`" + re.sub(r"\s*\n\s*", " ", text).replace("|", "\\|") + "`"


def panel_table_markdown() -> str:
    """For each dashboard a heading and a table of its panels: title | query | unit."""
    common_filter = DASHBOARD.of("")
    lines = [
        "Generated from `kvtune/observability/dashboards.py` by `make generate`; import `dashboards/*.json` "
        "into Grafana and pick a Prometheus data source. Every dashboard filters by data source, namespace, "
        "job, model and engine (Prometheus' `instance`); the queries below leave out the matchers they all "
        f"carry, {_code(common_filter)}.",
    ]
    for stem, data in all_dashboards().items():
        heading = f"`dashboards/{stem}.json`, uid `{data['uid']}`: {data['description']}"
        lines += [
            "",
            f"#### {data['title']}",
            "",
            heading,
            "",
            "| Panel | Query | Unit |",
            "| --- | --- | --- |",
        ]
        for panel in _panels(data):
            if panel["type"] == "row":
                continue
            queries = "<br>".join(_code(t["expr"].replace(common_filter, "")) for t in panel["targets"])
            unit = panel["fieldConfig"]["defaults"].get("unit", "")
            lines.append(f"| {panel['title']} | {queries} | {_code(unit) if unit else ''} |")
        for annotation in data.get("annotations", {}).get("list", []):
            tags = " and ".join(f"`{tag}`" for tag in annotation["target"]["tags"])
            lines += ["", f"Annotations, *{annotation['name']}*: Grafana annotations tagged {tags}."]
    return "\n".join(lines) + "\n"
