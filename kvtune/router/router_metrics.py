"""The router's own Prometheus metrics, in one registry per router (names from kvtune/metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvtune import metrics as names


def _counter(scraped_name: str) -> str:
    """prometheus-client adds `_total` to a counter's name itself."""
    return scraped_name.removesuffix("_total")


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            _counter(names.ROUTER_REQUESTS), "Requests routed, by engine, policy and the decision's reason",
            ["engine", "policy", "reason"], registry=registry,
        )  # fmt: skip
        self.matched_blocks = Histogram(
            names.ROUTER_MATCHED_BLOCKS, "Prefix blocks the chosen engine was judged to hold",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256), registry=registry,
        )  # fmt: skip
        self.upstream_errors = Counter(
            _counter(names.ROUTER_UPSTREAM_ERRORS),
            "Upstream calls that failed, by engine and kind (watch_*: the health watcher's reads of /health "
            "and /metrics that were malformed, too large or too slow)",
            ["engine", "kind"], registry=registry,
        )  # fmt: skip
        self.refused = Counter(
            _counter(names.ROUTER_REFUSED), "Requests refused before any engine saw them, by reason",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.overhead = Histogram(
            names.ROUTER_OVERHEAD_SECONDS,
            "Time from a request's arrival to its upstream call being sent (parsing, tokenising, routing)",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.1), registry=registry,
        )  # fmt: skip
        self.kv_events_resyncs = Counter(
            _counter(names.ROUTER_KV_EVENTS_RESYNCS),
            "Times an engine's KV-event view went stale (gap, unreadable batch, unknown parent, malformed "
            "removal) and the kv_events policy fell back to what the router sent it",
            ["engine", "cause"], registry=registry,
        )  # fmt: skip
        self.kv_events_rejected = Counter(
            _counter(names.ROUTER_KV_EVENTS_REJECTED),
            "KV events skipped because they were malformed or of an unknown kind, by engine and reason",
            ["engine", "reason"], registry=registry,
        )  # fmt: skip
        self.background_failures = Counter(
            _counter(names.ROUTER_BACKGROUND_FAILURES),
            "Times a background task (watch: the health watcher; kv_events: the KV-event follower) failed "
            "and was restarted; its engine gets no traffic until it reads healthy again",
            ["engine", "task"], registry=registry,
        )  # fmt: skip
