"""kvtune's Prometheus alert rules: each alert's query, threshold and advice in one typed definition.

The committed rules file (`deploy/prometheus/kvtune-alerts.yaml`) and the README's alert runbook are two
renderings of these definitions, written by `make generate` (tools/generate.py), whose `--check` a test
runs; `kvtune alerts` prints the rules for another SLO. Queries come from `promql.py` with no label
matchers, so the rules cover every engine Prometheus scrapes, one alert per engine (job, instance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import yaml

from kvtune import metrics
from kvtune.metrics_window import IDLE_QUANTILE, REUSE_GAP_QUANTILE
from kvtune.observability import promql
from kvtune.observability.promql import EVERYTHING
from kvtune.slo import DEFAULT_TTFT_P99_SLO_S as DEFAULT_TTFT_P99_SLO_S  # re-exported: its old home

# Where the rules file sits in a kvtune checkout (tools/generate.py writes it there).
RULES_PATH = "deploy/prometheus/kvtune-alerts.yaml"
GROUP = "kvtune"

# Thresholds, windows and `for` durations: the rules, the runbook and (later) dashboards read them here.
PREFIX_CACHE_HIT_RATE_MIN = 0.9
# The hit rate a healthy long-running service keeps (dashboards: green; the doctor: healthy). Above it there
# is little left to win from a larger pool.
PREFIX_CACHE_HIT_RATE_HEALTHY = 0.95
PREFIX_CACHE_WINDOW = "10m"
PREFIX_CACHE_FOR = "10m"
PREEMPTION_WINDOW = "5m"
# Preemptions come in bursts: a burst keeps the 5m increase above 0 for about 5m, so a `for` much
# shorter than the window is what lets a single burst fire at all. 1m (not 0m) keeps a pending state,
# which a live test sees within a couple of minutes of the first preemption.
PREEMPTION_FOR = "1m"
KV_CACHE_USAGE_MAX = 0.95
KV_CACHE_FOR = "5m"
WAITING_FOR_CAPACITY_FOR = "5m"
TTFT_QUANTILE = 0.99
TTFT_WINDOW = "5m"
TTFT_FOR = "5m"
# Evictions before reuse (kvtune.observability.residency says why these quantiles): judged only on at least
# this many sampled evictions and reuse gaps in the window, fewer being noise.
RESIDENCY_WINDOW = "10m"
RESIDENCY_FOR = "10m"
RESIDENCY_MIN_OBSERVATIONS = 20

Severity = Literal["warning", "critical"]


@dataclass(frozen=True)
class Runbook:
    """The README's subsection for one alert."""

    meaning: str
    computed: str
    change: str


@dataclass(frozen=True)
class AlertRule:
    """One Prometheus alerting rule and its runbook; summary and description are Prometheus templates."""

    name: str
    expr: str
    for_: str
    severity: Severity
    summary: str
    description: str
    runbook: Runbook

    def to_rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def number_text(value: float) -> str:
    """2.0 -> "2", 0.25 -> "0.25": short, and exact (repr) when %g would round."""
    short = f"{value:g}"
    return short if float(short) == value else repr(value)


def _percent(fraction: float) -> str:
    return f"{number_text(fraction * 100)}%"


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


_KV_BUDGET = (
    "Raise the KV budget (`kv_cache_memory_bytes`, or `gpu_memory_utilization` when the profile sets "
    "that instead) or set `kv_cache_dtype: fp8`, which holds twice the tokens of a 16-bit cache in the "
    "same bytes"
)


def _prefix_cache_hit_rate_low() -> AlertRule:
    hit_rate = promql.prefix_cache_hit_rate(EVERYTHING, PREFIX_CACHE_WINDOW)
    queries = promql.prefix_cache_queries_per_s(EVERYTHING, PREFIX_CACHE_WINDOW)
    target = _percent(PREFIX_CACHE_HIT_RATE_MIN)
    return AlertRule(
        name="KvtunePrefixCacheHitRateLow",
        expr=f"(\n{_indent(hit_rate)}\n) < {number_text(PREFIX_CACHE_HIT_RATE_MIN)}\nand\n{queries} > 0",
        for_=PREFIX_CACHE_FOR,
        severity="warning",
        summary=(
            f"Prefix-cache hit rate under {target} on {{{{ $labels.instance }}}}: raise the KV budget or "
            "use an fp8 KV cache"
        ),
        description=(
            "{{ $labels.instance }} found {{ $value | humanizePercentage }} of its queried prompt tokens "
            f"in the prefix cache over the last {PREFIX_CACHE_WINDOW} (target {target}): shared prefixes "
            "are evicted before they are reused. Raise kv_cache_memory_bytes or gpu_memory_utilization, or "
            "set kv_cache_dtype fp8."
        ),
        runbook=Runbook(
            meaning=(
                f"Over the last {PREFIX_CACHE_WINDOW} the engine found less than {target} of the prompt "
                "tokens it looked up in its prefix cache, for "
                f"{PREFIX_CACHE_FOR} on end, while serving traffic. Prompts that share a system prompt, a "
                "document or a chat history should mostly hit; a low rate means the KV pool is too small to "
                "keep those prefixes until they are asked for again, so each one is prefilled again and "
                "time to first token grows. vLLM never counts the last prompt token or a partly filled "
                "block as a hit, so a workload whose prompts share little (or are short next to "
                f"`block_size`) cannot reach {target}: silence the alert for such an engine."
            ),
            computed=(
                f"Hit rate = rate of `{metrics.PREFIX_CACHE_HITS}` / rate of "
                f"`{metrics.PREFIX_CACHE_QUERIES}` (both count prompt tokens) over {PREFIX_CACHE_WINDOW}, "
                f"per engine. The `and ... > 0` clause keeps it quiet without traffic: an idle engine, or "
                "one with `enable_prefix_caching: false`, queries nothing and has no hit rate to judge."
            ),
            change=(
                f"{_KV_BUDGET}; a larger pool keeps more prefixes cached. Check "
                "`enable_prefix_caching` is true (kvtune's default). If the KV cache is also nearly full "
                "because many sequences run at once, a lower `max_num_seqs` leaves the cached prefixes room. "
                "`kvtune sweep` measures which of these pays on the real workload."
            ),
        ),
    )


def _preemptions() -> AlertRule:
    return AlertRule(
        name="KvtunePreemptions",
        expr=f"{promql.preemptions_in(EVERYTHING, PREEMPTION_WINDOW)} > 0",
        for_=PREEMPTION_FOR,
        severity="warning",
        summary=(
            "Requests preempted on {{ $labels.instance }}: raise the KV budget, use an fp8 KV cache or "
            "lower max_num_seqs"
        ),
        description=(
            '{{ $labels.instance }} preempted about {{ printf "%.0f" $value }} requests in the last '
            f"{PREEMPTION_WINDOW}: its KV pool ran out of blocks for the running sequences, so vLLM evicted "
            "some and will prefill them again. Raise kv_cache_memory_bytes or gpu_memory_utilization, set "
            "kv_cache_dtype fp8, or lower max_num_seqs."
        ),
        runbook=Runbook(
            meaning=(
                "Running sequences needed more KV blocks than the pool had free, so vLLM evicted (preempted) "
                "some of them: their KV cache is dropped and they are prefilled again from the start later. "
                "Each preemption is wasted prefill work and a latency spike for that request; a healthy "
                "engine preempts nothing."
            ),
            computed=(
                f"`increase({metrics.PREEMPTIONS}[{PREEMPTION_WINDOW}])` per engine above 0. The "
                f"`for` is short ({PREEMPTION_FOR}) on purpose: one burst of preemptions keeps the "
                f"{PREEMPTION_WINDOW} increase above 0 for only about {PREEMPTION_WINDOW}, so a longer "
                "`for` would let bursts pass unseen."
            ),
            change=(
                f"{_KV_BUDGET}. Or lower `max_num_seqs`, so fewer sequences "
                "share the pool and each one's growth fits; `max_model_len` bounds how much one sequence "
                "can take."
            ),
        ),
    )


def _kv_cache_nearly_full() -> AlertRule:
    limit = _percent(KV_CACHE_USAGE_MAX)
    return AlertRule(
        name="KvtuneKvCacheNearlyFull",
        expr=f"{promql.kv_cache_usage(EVERYTHING)} > {number_text(KV_CACHE_USAGE_MAX)}",
        for_=KV_CACHE_FOR,
        severity="warning",
        summary=(
            f"KV cache over {limit} full on {{{{ $labels.instance }}}}: raise the KV budget or use an fp8 "
            "KV cache"
        ),
        description=(
            "{{ $labels.instance }} has {{ $value | humanizePercentage }} of its KV blocks in use "
            f"(over {limit} for {KV_CACHE_FOR}): new requests wait and running ones are preempted next. "
            "Raise kv_cache_memory_bytes or gpu_memory_utilization, set kv_cache_dtype fp8, or lower "
            "max_num_seqs."
        ),
        runbook=Runbook(
            meaning=(
                f"More than {limit} of the engine's KV blocks have been in use for {KV_CACHE_FOR} on end. "
                "The next sequence that grows, or the next request admitted, finds no free block: requests "
                "queue (KvtuneRequestsWaitingForCapacity) and running ones are preempted "
                "(KvtunePreemptions). It is the early warning of both."
            ),
            computed=(
                f"`{metrics.KV_CACHE_USAGE}` (a 0-1 gauge of the blocks in use) per engine above "
                f"{number_text(KV_CACHE_USAGE_MAX)}, at every evaluation for {KV_CACHE_FOR}."
            ),
            change=(
                f"{_KV_BUDGET}. If the memory is not there, lower `max_num_seqs` "
                "(fewer sequences hold blocks at once) or `max_model_len`."
            ),
        ),
    )


def _requests_waiting_for_capacity() -> AlertRule:
    return AlertRule(
        name="KvtuneRequestsWaitingForCapacity",
        expr=f"{promql.requests_waiting_for_capacity(EVERYTHING)} > 0",
        for_=WAITING_FOR_CAPACITY_FOR,
        severity="warning",
        summary=(
            "Requests waiting for capacity on {{ $labels.instance }}: raise the KV budget, or max_num_seqs "
            "when the KV cache has room"
        ),
        description=(
            "{{ $labels.instance }} has had requests waiting for KV or batch room for "
            f"{WAITING_FOR_CAPACITY_FOR} ({{{{ $value }}}} now). If its KV cache is nearly full, raise "
            "kv_cache_memory_bytes or gpu_memory_utilization, or set kv_cache_dtype fp8; if not, raise "
            "max_num_seqs or max_num_batched_tokens."
        ),
        runbook=Runbook(
            meaning=(
                "Requests have been queueing, not running, for "
                f"{WAITING_FOR_CAPACITY_FOR}: the scheduler has had no room for them, either no free KV "
                "blocks or a full batch (`max_num_seqs` sequences, or `max_num_batched_tokens` tokens in a "
                "step). Their time in the queue is added to their time to first token."
            ),
            computed=(
                f"`{metrics.REQUESTS_WAITING_BY_REASON}{{{promql.WAITING_FOR_CAPACITY}}}` per engine above 0 "
                "at every "
                f"evaluation for {WAITING_FOR_CAPACITY_FOR}; requests vLLM defers for other reasons (LoRA "
                'budget, KV transfer) carry `reason="deferred"` and do not count.'
            ),
            change=(
                "Look at the KV cache usage of the same engine. Near full, the pool is the limit. "
                f"{_KV_BUDGET}. With room left, the batch is the limit: raise `max_num_seqs`, or "
                "`max_num_batched_tokens` when long prompts fill each step. If the engine is already as "
                "large as its accelerator allows, add engines."
            ),
        ),
    )


def _ttft_p99_above_slo(slo_s: float) -> AlertRule:
    slo = f"{number_text(slo_s)}s"
    quantile = promql.latency_quantile(metrics.TTFT_SECONDS, TTFT_QUANTILE, EVERYTHING, TTFT_WINDOW)
    observed = promql.latency_observations_per_s(metrics.TTFT_SECONDS, EVERYTHING, TTFT_WINDOW)
    return AlertRule(
        name="KvtuneTtftP99AboveSlo",
        expr=f"{quantile}\n> {number_text(slo_s)}\nand\n{observed} > 0",
        for_=TTFT_FOR,
        severity="critical",
        summary=(
            f"P99 time to first token above the {slo} SLO on {{{{ $labels.instance }}}}: raise the KV "
            "budget or max_num_batched_tokens"
        ),
        description=(
            "{{ $labels.instance }} gave 99% of its requests their first token within "
            f"{{{{ $value | humanizeDuration }}}} over the last {TTFT_WINDOW}, above the {slo} SLO. If "
            "requests queue, raise kv_cache_memory_bytes or gpu_memory_utilization or set kv_cache_dtype "
            "fp8; if prefill is slow, raise max_num_batched_tokens and keep enable_prefix_caching on."
        ),
        runbook=Runbook(
            meaning=(
                f"The slowest 1% of requests waited more than {slo} (the SLO the rules were rendered with) "
                f"for their first token over the last {TTFT_WINDOW}, for {TTFT_FOR} on end. Time to first "
                "token is time in the queue plus prefill: one of the two has outgrown the engine's settings."
            ),
            computed=(
                f"`histogram_quantile({number_text(TTFT_QUANTILE)}, ...)` of "
                f"`{metrics.TTFT_SECONDS}_bucket` rates over {TTFT_WINDOW}, per engine, above "
                f"{number_text(slo_s)}; the `and ... > 0` clause on the histogram's `_count` keeps it quiet "
                "while no request gets a first token. `kvtune alerts --ttft-slo SECONDS` prints the rules "
                "for another SLO."
            ),
            change=(
                f"Split the time on the dashboard (queue time `{metrics.QUEUE_TIME_SECONDS}`, "
                f"prefill time `{metrics.PREFILL_TIME_SECONDS}`). When queue time dominates, the "
                f"engine lacks room. {_KV_BUDGET}, or, when its KV cache has room, raise `max_num_seqs`. "
                "When prefill dominates, raise "
                "`max_num_batched_tokens` (a larger prefill chunk per step, at some cost in inter-token "
                "latency) and keep "
                "`enable_prefix_caching` on so shared prefixes skip prefill. `kvtune sweep` with this SLO "
                "finds the setting that holds it."
            ),
        ),
    )


def residency_expr(sel: promql.Selector, window: str) -> str:
    """Reuse reaching the eviction horizon while hits are lost: the p90 reuse gap at or above the median
    idle time before eviction, on enough observations of both, with the hit rate below healthy. Its value
    is the p90 reuse gap, seconds."""
    gaps = promql.block_residency_quantile(
        metrics.KV_BLOCK_REUSE_GAP_SECONDS, REUSE_GAP_QUANTILE, sel, window
    )
    idle = promql.block_residency_quantile(
        metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS, IDLE_QUANTILE, sel, window
    )
    least = RESIDENCY_MIN_OBSERVATIONS
    counted = [
        f"{promql.histogram_observations_in(histogram, sel, window)} >= {least}"
        for histogram in (metrics.KV_BLOCK_REUSE_GAP_SECONDS, metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS)
    ]
    hit_rate = promql.prefix_cache_hit_rate(sel, window)
    healthy = number_text(PREFIX_CACHE_HIT_RATE_HEALTHY)
    return (
        f"{gaps}\n>=\n{idle}\nand\n"
        + "\nand\n".join(counted)
        + f"\nand\n(\n{_indent(hit_rate)}\n) < {healthy}"
    )


def _evictions_before_reuse() -> AlertRule:
    window, least = RESIDENCY_WINDOW, RESIDENCY_MIN_OBSERVATIONS
    gap_q, idle_q = f"p{number_text(REUSE_GAP_QUANTILE * 100)}", f"p{number_text(IDLE_QUANTILE * 100)}"
    return AlertRule(
        name="KvtuneEvictionsBeforeReuse",
        expr=residency_expr(EVERYTHING, window),
        for_=RESIDENCY_FOR,
        severity="warning",
        summary=(
            "KV blocks evicted before their reuse on {{ $labels.instance }}: raise the KV budget (kvtune "
            "doctor says by how much)"
        ),
        description=(
            "{{ $labels.instance }}'s prefix-cache reuses wait up to {{ $value | humanizeDuration }} "
            f"({gap_q} of its KV blocks' reuse gaps over the last {window}), as long as a block stays cached "
            f"idle ({idle_q} before eviction), and its hit rate is under "
            f"{_percent(PREFIX_CACHE_HIT_RATE_HEALTHY)}: prefixes asked for again later are prefilled again. "
            "Raise kv_cache_memory_bytes, gpu_memory_utilization or num_gpu_blocks_override, or set "
            "kv_cache_dtype fp8; kvtune doctor gives the size."
        ),
        runbook=Runbook(
            meaning=(
                "The engine evicts KV blocks about as soon as its traffic comes back for them. vLLM's "
                "residency histograms (profile field `kv_cache_metrics`) record, when a sampled block is "
                "evicted, how long it sat idle and the gaps between its prefix-cache hits; a hit that came "
                "after the block was gone leaves no gap, so the gaps seen stop where eviction begins. When "
                f"their {gap_q} reaches the {idle_q} idle time before eviction, reuse runs into that horizon "
                "and the reuses a little later are the ones lost, prefilled again (the hit rate below "
                f"{_percent(PREFIX_CACHE_HIT_RATE_HEALTHY)} says so)."
            ),
            computed=(
                f"`histogram_quantile({number_text(REUSE_GAP_QUANTILE)}, ...)` of "
                f"`{metrics.KV_BLOCK_REUSE_GAP_SECONDS}_bucket` rates at or above "
                f"`histogram_quantile({number_text(IDLE_QUANTILE)}, ...)` of "
                f"`{metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS}_bucket` rates over {window}, per engine, "
                f"with at least {least} of each counted in the window (fewer are noise; the histograms "
                "follow the share of blocks `kv_cache_metrics_sample` picks) and the prefix-cache hit rate "
                f"below {number_text(PREFIX_CACHE_HIT_RATE_HEALTHY)}: vLLM hands each request's last, partly "
                "filled block to the next request first, recorded as a quick eviction, so on traffic of few "
                "blocks per request the median idle time can look short on a pool that loses nothing. An "
                "engine "
                "without `kv_cache_metrics` exports no such series and never fires it."
            ),
            change=(
                "Grow the pool: `kv_cache_memory_bytes` (or `gpu_memory_utilization` when the profile sets "
                "that), `num_gpu_blocks_override` when it caps the pool, or `kv_cache_dtype: fp8` for twice "
                "the tokens in the same bytes; on a GPU, `kv_offloading_size` keeps evicted blocks in host "
                "memory instead. Under LRU a block's idle time before eviction grows with the pool at a "
                "fixed arrival of new blocks; `kvtune doctor` shows that arithmetic for the engine and the "
                "size to set."
            ),
        ),
    )


def alert_rules(ttft_p99_slo_seconds: float = DEFAULT_TTFT_P99_SLO_S) -> list[AlertRule]:
    """Every kvtune alert, in the order of the rules file and the runbook."""
    if not (math.isfinite(ttft_p99_slo_seconds) and ttft_p99_slo_seconds > 0):
        raise ValueError(
            f"ttft_p99_slo_seconds: {ttft_p99_slo_seconds!r} is not a positive number of seconds; "
            f"give one such as {number_text(DEFAULT_TTFT_P99_SLO_S)}"
        )
    return [
        _prefix_cache_hit_rate_low(),
        _preemptions(),
        _kv_cache_nearly_full(),
        _requests_waiting_for_capacity(),
        _ttft_p99_above_slo(ttft_p99_slo_seconds),
        _evictions_before_reuse(),
    ]


class _RulesDumper(yaml.SafeDumper):
    """Lists indented under their key and multi-line strings (the queries) as `|` blocks, so the file
    reads like a hand-written one."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_RulesDumper.add_representer(str, _represent_str)

HEADER = (
    "# Generated from kvtune/observability/alerts.py by `make generate` (tools/generate.py);\n"
    "# edit the definitions there, not this file. Load it with Prometheus' `rule_files`.\n"
)


def rules_yaml(rules: Sequence[AlertRule]) -> str:
    """A Prometheus rules file holding RULES as the one group `kvtune`."""
    document = {"groups": [{"name": GROUP, "rules": [rule.to_rule() for rule in rules]}]}
    body = yaml.dump(document, Dumper=_RulesDumper, sort_keys=False, allow_unicode=True, width=1_000)
    return HEADER + body


def render_rules(ttft_p99_slo_seconds: float = DEFAULT_TTFT_P99_SLO_S) -> str:
    """The rules file, with the P99 TTFT alert at the given SLO."""
    return rules_yaml(alert_rules(ttft_p99_slo_seconds))


def alert_expressions(ttft_p99_slo_seconds: float = DEFAULT_TTFT_P99_SLO_S) -> list[tuple[str, str]]:
    """(alert name, expr) of every rule: what a live test evaluates through Prometheus' HTTP API."""
    return [(rule.name, rule.expr) for rule in alert_rules(ttft_p99_slo_seconds)]


def runbook_markdown(ttft_p99_slo_seconds: float = DEFAULT_TTFT_P99_SLO_S) -> str:
    """The README's alert runbook: one subsection per alert."""
    parts = [
        f"`{RULES_PATH}` holds these alerts (group `{GROUP}`, one alert per engine: "
        "Prometheus' `job` and `instance`); load it with `rule_files`. Each names the profile fields to "
        "change.\n"
    ]
    for rule in alert_rules(ttft_p99_slo_seconds):
        book = rule.runbook
        parts.append(
            f"#### {rule.name}\n\n"
            f"Severity `{rule.severity}`, `for: {rule.for_}`.\n\n"
            f"**What it means.** {book.meaning}\n\n"
            f"**How it is computed.** {book.computed}\n\n"
            f"```promql\n{rule.expr}\n```\n\n"
            f"**What to change.** {book.change}\n"
        )
    return "\n".join(parts)
