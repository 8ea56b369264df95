"""The PromQL kvtune's dashboards and alert rules share: one expression per fact, built on kvtune.metrics.

Counters are read through `rate()` over a window, never as lifetime ratios (a lifetime hit rate hides a
cache that stopped hitting an hour ago); ratios sum numerator and denominator over the same labels before
dividing, so an engine with no traffic yields no series rather than 0/0. Every query takes a Selector
(the label matchers: Grafana template variables on dashboards, none in alert rules) and a window
(`$__rate_interval` on dashboards, a fixed duration in rules).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvtune import metrics
from kvtune.credentials import value_looks_secret

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


# ---- label matchers a user types (`kvtune doctor --prometheus --selector`) ---------------------------------
# Parsed, never pasted: a value is read as the PromQL string it is and rendered back escaped, so no text a
# user types can close the braces and add to the query.

# Prometheus' label names (its data model); those starting with "__" are its own (__name__, __address__).
LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Longest first, so "=~" is not read as "=" followed by "~".
MATCH_OPERATORS = ("=~", "!~", "!=", "=")
MAX_SELECTOR_CHARS = 1024
SELECTOR_EXAMPLE = 'job="vllm", instance="host:8000"'
# PromQL's string escapes (Go's): a letter, the quote, a byte in hex or octal, a code point in hex.
_ESCAPE = re.compile(
    r"\\(?:(?P<letter>[abfnrtv\\\"'])|x(?P<hex>[0-9A-Fa-f]{2})|(?P<octal>[0-3][0-7]{2})"
    r"|u(?P<u4>[0-9A-Fa-f]{4})|U(?P<u8>[0-9A-Fa-f]{8}))"
)
_LETTERS = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


class SelectorError(ValueError):
    """Text that is not a list of label matchers; str() says where, and what a matcher looks like."""


@dataclass(frozen=True)
class Matcher:
    """One label matcher, e.g. `instance=~"host:.*"`: a label name, an operator and the value as text."""

    name: str
    op: str
    value: str

    def render(self) -> str:
        return f"{self.name}{self.op}{quoted(self.value)}"


def quoted(value: str) -> str:
    """VALUE as a double-quoted PromQL string: backslash and quote escaped, and every character that is not
    printable (a newline, a terminal escape) written as its escape, so that it reads back as VALUE in
    Prometheus (Go's string rules) and shows as plain text wherever it is printed."""
    out = []
    for char in value:
        code = ord(char)
        if char in '\\"':
            out.append("\\" + char)
        elif char.isprintable():
            out.append(char)
        elif code < 0x80:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def parse_selector(text: str) -> Selector:
    """Label matchers as typed (`job="vllm", instance=~"h:.*"`, braces optional, values in double, single
    or back quotes with PromQL's escapes) -> a Selector whose matchers are rendered escaped; SelectorError
    naming the place and the form otherwise."""
    return Selector(tuple(matcher.render() for matcher in parse_matchers(text)))


def parse_matchers(text: str) -> list[Matcher]:
    """The matchers of TEXT (see parse_selector); SelectorError for anything else."""
    if len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(
            f"longer than {MAX_SELECTOR_CHARS:,} characters; name one engine with a few label matchers, "
            f"e.g. {SELECTOR_EXAMPLE}"
        )
    return _Matchers(text).read()


class _Matchers:
    """A left-to-right reading of one selector's text."""

    def __init__(self, text: str) -> None:
        self.text = text
        stripped = text.strip()
        braced = stripped.startswith("{") and stripped.endswith("}")
        self.body = stripped[1:-1] if braced else stripped
        self.offset = len(text) - len(text.lstrip()) + braced  # where body starts in text
        self.at = 0

    def read(self) -> list[Matcher]:
        matchers = []
        self.blank()
        while self.at < len(self.body):
            name = LABEL_NAME.match(self.body, self.at)
            if name is None:
                raise self.refused("a label name (letters, digits and _, not first a digit)")
            if name.group().startswith("__"):
                raise self.refused("a label name not starting with __ (those are Prometheus' own)")
            self.at = name.end()
            self.blank()
            op = next((op for op in MATCH_OPERATORS if self.body.startswith(op, self.at)), None)
            if op is None:
                raise self.refused("one of =, !=, =~, !~")
            self.at += len(op)
            self.blank()
            matchers.append(Matcher(name.group(), op, self.string()))
            self.blank()
            if self.at < len(self.body):
                if self.body[self.at] != ",":
                    raise self.refused("a comma before the next matcher")
                self.at += 1
                self.blank()
        return matchers

    def blank(self) -> None:
        while self.at < len(self.body) and self.body[self.at].isspace():
            self.at += 1

    def string(self) -> str:
        """The string literal here, as its value."""
        body, start = self.body, self.at
        quote = body[start : start + 1]
        if quote not in ('"', "'", "`"):
            raise self.refused('a quoted value (e.g. "vllm")')
        if quote == "`":  # a raw string: no escapes
            end = body.find("`", start + 1)
            if end < 0:
                raise self.refused("a closing `")
            self.at = end + 1
            return body[start + 1 : end]
        out = bytearray()
        self.at += 1
        while self.at < len(body) and body[self.at] not in (quote, "\n"):
            if body[self.at] != "\\":
                out += body[self.at].encode("utf-8", "surrogatepass")
                self.at += 1
                continue
            escape = _ESCAPE.match(body, self.at)
            if escape is None:
                raise self.refused(r"a known escape (\n, \t, \\, \", \xHH, \uHHHH, ...)")
            out += _escaped(escape)
            self.at = escape.end()
        if body[self.at : self.at + 1] != quote:
            self.at = start
            raise self.refused(f"a closing {quote} on the same line")
        self.at += 1
        try:
            return out.decode("utf-8")
        except UnicodeDecodeError:
            self.at = start
            raise self.refused("a value whose escapes spell UTF-8 text") from None

    def refused(self, expected: str) -> SelectorError:
        text = self.text
        shown = "the value given" if value_looks_secret(text) else repr(text[:80] + "..." * (len(text) > 80))
        return SelectorError(
            f"{shown} is not a list of label matchers: expected {expected} at character "
            f"{self.offset + self.at + 1}; give e.g. {SELECTOR_EXAMPLE} (=, !=, =~ or !~, quoted values, "
            "comma separated)"
        )


def _escaped(escape: re.Match[str]) -> bytes:
    """The bytes one escape stands for: \\x and octal ones a byte, \\u and \\U a code point's UTF-8."""
    letter, hex_byte, octal = escape.group("letter", "hex", "octal")
    if letter:
        return _LETTERS.get(letter, letter).encode()
    if hex_byte or octal:
        return bytes([int(hex_byte, 16) if hex_byte else int(octal, 8)])
    code = int(escape.group("u4") or escape.group("u8"), 16)
    if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:  # Go refuses these too
        return b"\xff"  # no UTF-8 text: refused by the decoding
    return chr(code).encode()


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
