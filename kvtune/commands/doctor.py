"""`kvtune doctor URL`: read a running vLLM engine's own counters over a window and say what ails it.

The engine's /metrics is scraped at the start and the end of the window, and its gauges every second in
between (Ctrl-C ends the window early); with `--prometheus`, URL is a Prometheus server that already holds
the same series, queried over the last window. The judging is `kvtune.observability.doctor`'s.
Exit codes: 0 healthy, 1 a warning, 2 the engine (or Prometheus) cannot be read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kvtune import kv_math, metrics
from kvtune.commands.common import ExitCode, stop_requested_by_signals
from kvtune.commands.load import UsageError, api_key
from kvtune.observability import alerts, doctor, promql
from kvtune.openai_client import client_for

SAMPLE_EVERY_S = 1.0
DEFAULT_WINDOW_S = 30.0


class ReadError(Exception):
    """The engine or Prometheus cannot be read; str() names the URL and the fix."""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        metavar="URL",
        help="engine base URL, e.g. http://127.0.0.1:8000 (with --prometheus: the Prometheus server's)",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=DEFAULT_WINDOW_S,
        metavar="SECONDS",
        help="seconds to watch (with --prometheus: the last SECONDS) (default %(default)g)",
    )
    parser.add_argument(
        "--api-key-env",
        metavar="NAME",
        default=None,
        help="read the engine's API key from environment variable NAME (default: KVTUNE_API_KEY, when set)",
    )
    parser.add_argument(
        "--prometheus", action="store_true", help="URL is a Prometheus server that scrapes the engine"
    )
    parser.add_argument(
        "--selector",
        default="",
        metavar="MATCHERS",
        help='with --prometheus: label matchers naming one engine, e.g. \'job="vllm", instance="a:8000"\'',
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="model directory (with config.json) or known model name that sizes KV bytes per token "
        "(default: the engine's /v1/models root)",
    )
    parser.add_argument(
        "--ttft-slo",
        type=float,
        default=doctor.DEFAULT_TTFT_P99_S,
        metavar="SECONDS",
        help="P99 time to first token, seconds, above which TTFT is a warning (default %(default)g)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


# ---- reading the engine --------------------------------------------------------------------------------


@dataclass
class Observation:
    """What a reader saw: the window's facts, the pool's labels and where the model's config may be."""

    facts: doctor.WindowFacts
    cache: dict[str, str]
    capacity: metrics.KvCapacity | None
    model: str | None = None
    why_no_model: str = ""
    ended_early: bool = False
    notes: list[str] = field(default_factory=list)


def base_url(url: str) -> str:
    """URL without a trailing slash or `/metrics`; UsageError unless it is an http(s) URL with a host."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"URL {url!r}: expected a base URL such as http://127.0.0.1:8000")
    return url.strip().rstrip("/").removesuffix("/metrics").rstrip("/")


def _get(client: httpx.Client, url: str, what: str, fix: str) -> httpx.Response:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise ReadError(f"cannot reach {url} ({exc.__class__.__name__}: {exc}); {fix}") from None
    if response.status_code in (401, 403):
        raise ReadError(
            f"{url} answered HTTP {response.status_code}: {what} needs an API key; "
            "pass it with --api-key-env NAME"
        )
    if response.status_code != 200:
        raise ReadError(
            f"{url} answered HTTP {response.status_code}: check that URL is {what}'s base URL ({fix})"
        )
    return response


def scrape(client: httpx.Client, url: str) -> list[metrics.Sample]:
    """One scrape of a vLLM engine's /metrics; ReadError when it is not one."""
    target = f"{url}/metrics"
    response = _get(client, target, "a vLLM engine", "start the engine, or check the host and port")
    not_vllm = (
        f"{target} has no vllm: metrics: {url} is not a vLLM engine; give a vLLM server's base URL "
        "(or a Prometheus server's, with --prometheus)"
    )
    try:
        samples = metrics.parse(response.text)
    except ValueError:
        raise ReadError(not_vllm) from None
    if not any(sample.name.startswith("vllm:") for sample in samples):
        raise ReadError(not_vllm)
    return samples


def served_model(client: httpx.Client, url: str) -> tuple[str | None, str]:
    """Where the engine's model lives (its /v1/models `root`, else its name), or why it is unknown."""
    target = f"{url}/v1/models"
    try:
        response = client.get(target)
    except httpx.HTTPError as exc:
        return None, f"{target} failed ({exc.__class__.__name__}); pass --model DIR"
    if response.status_code != 200:
        fix = "pass its key with --api-key-env NAME, or --model DIR"
        return None, f"{target} answered HTTP {response.status_code}; " + (
            fix if response.status_code in (401, 403) else "pass --model DIR"
        )
    try:
        models = response.json().get("data") or []
        entry = next(m for m in models if isinstance(m, dict) and not m.get("parent"))
    except (ValueError, AttributeError, StopIteration):
        return None, f"{target} lists no model; pass --model DIR"
    return str(entry.get("root") or entry.get("id")), ""


def watch_engine(
    client: httpx.Client,
    url: str,
    window_s: float,
    wait: Callable[[float], bool],
    clock: Callable[[], float] = time.monotonic,
    on_tick: Callable[[float], None] = lambda _elapsed: None,
) -> Observation:
    """Scrape at the start and the end of the window and sample the gauges in between.

    `wait` pauses up to the given seconds and returns True when the user asked to stop (Ctrl-C): the
    window then ends early and what was seen is still diagnosed.
    """
    before = scrape(client, url)
    peaks = doctor.Peaks()
    peaks.update(before)
    start = clock()
    deadline = start + window_s
    after, ended_early = before, False
    while (now := clock()) < deadline:
        ended_early = wait(min(SAMPLE_EVERY_S, deadline - now))
        after = scrape(client, url)
        peaks.update(after)
        if ended_early:
            break
        on_tick(clock() - start)
    seconds = clock() - start
    model, why = served_model(client, url)
    facts = doctor.facts_from_snapshots(before, after, peaks, seconds)
    return Observation(
        facts, metrics.cache_config(after), doctor.capacity_of(after), model, why, ended_early=ended_early
    )


# ---- reading Prometheus --------------------------------------------------------------------------------


def selector(matchers: str) -> promql.Selector:
    text = matchers.strip().removeprefix("{").removesuffix("}").strip()
    return promql.Selector((text,) if text else ())


def _query(client: httpx.Client, url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's vector result, [] when no series matched."""
    target = f"{url}/api/v1/query"
    fix = "start Prometheus, or check the host and port"
    try:
        response = client.get(target, params={"query": expr})
    except httpx.HTTPError as exc:
        raise ReadError(f"cannot reach {target} ({exc.__class__.__name__}: {exc}); {fix}") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "status" not in body:
        raise ReadError(
            f"{target} answered HTTP {response.status_code}, not as Prometheus' HTTP API: give a "
            "Prometheus server's base URL, e.g. http://127.0.0.1:9090 (or drop --prometheus for an engine)"
        )
    if body["status"] != "success":
        raise ReadError(
            f"{target} refused the query ({body.get('error', '?')}): check --selector; query: {expr}"
        )
    result = body.get("data", {}).get("result", [])
    return result if isinstance(result, list) else []


def _value(result: list[dict[str, Any]]) -> float | None:
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) else value


def read_prometheus(client: httpx.Client, url: str, window_s: float, matchers: str) -> Observation:
    """The same facts as `watch_engine`, over the last window, from a Prometheus server's HTTP API."""
    sel = selector(matchers)
    engines = _query(client, url, promql.cache_config_info(sel))
    shown = matchers or "no --selector"
    if not engines:
        raise ReadError(
            f"{url} has no {metrics.CACHE_CONFIG_INFO} series ({shown}): check that Prometheus scrapes the "
            "engine and that --selector matches it"
        )
    # One vLLM server with several engine cores (data parallel) exports one series per core.
    servers = sorted({(e["metric"].get("job", "?"), e["metric"].get("instance", "?")) for e in engines})
    if len(servers) > 1:
        found = ", ".join(f'instance="{instance}"' for _job, instance in servers[:5])
        raise ReadError(
            f"{url}: {len(servers)} engines match ({shown}): {found}; the doctor reads one: "
            "narrow --selector, e.g. --selector 'instance=\"host:8000\"'"
        )
    window = f"{max(round(window_s), 1)}s"
    step = f"{max(math.ceil(window_s / 1000), 1)}s"

    def scalar(expr: str) -> float | None:
        return _value(_query(client, url, expr))

    def increase(metric: str) -> float | None:
        return scalar(f"sum(increase({sel.of(metric)}[{window}]))")

    def mean(histogram: str) -> float | None:
        total, count = increase(f"{histogram}_sum"), increase(f"{histogram}_count")
        return total / count if total is not None and count else None

    def lifetime_mean(histogram: str) -> float | None:
        total = scalar(f"sum({sel.of(f'{histogram}_sum')})")
        count = scalar(f"sum({sel.of(f'{histogram}_count')})")
        return total / count if total is not None and count else None

    def peak(expr: str) -> float:
        return scalar(f"max_over_time(({expr})[{window}:{step}])") or 0.0

    by_reason = _query(
        client,
        url,
        f"max_over_time(({promql.requests_waiting_by_reason(sel, promql.FLEET)})[{window}:{step}])",
    )
    peaks = doctor.Peaks(
        kv_usage=peak(promql.kv_cache_usage(sel, promql.FLEET)),
        running=peak(promql.requests_running(sel, promql.FLEET)),
        waiting=peak(promql.requests_waiting(sel, promql.FLEET)),
        waiting_by_reason={str(r["metric"].get("reason", "?")): float(r["value"][1]) for r in by_reason},
    )
    queries = increase(metrics.PREFIX_CACHE_QUERIES)
    notes = []
    if queries is None:
        notes.append(
            f"Prometheus holds too few samples in the last {window} to compute increases: widen --window "
            "to several scrape intervals"
        )
    facts = doctor.WindowFacts(
        seconds=window_s,
        hits=increase(metrics.PREFIX_CACHE_HITS) or 0.0,
        queries=queries or 0.0,
        lifetime_hits=scalar(f"sum({sel.of(metrics.PREFIX_CACHE_HITS)})") or 0.0,
        lifetime_queries=scalar(f"sum({sel.of(metrics.PREFIX_CACHE_QUERIES)})") or 0.0,
        preemptions=scalar(promql.preemptions_in(sel, window, promql.FLEET)) or 0.0,
        prompt_tokens=increase(metrics.PROMPT_TOKENS) or 0.0,
        generation_tokens=increase(metrics.GENERATION_TOKENS) or 0.0,
        finished=increase(metrics.REQUEST_SUCCESS) or 0.0,
        first_tokens=increase(f"{metrics.TTFT_SECONDS}_count") or 0.0,
        mean_ttft_s=mean(metrics.TTFT_SECONDS),
        p99_ttft_s=scalar(
            promql.latency_quantile(metrics.TTFT_SECONDS, alerts.TTFT_QUANTILE, sel, window, promql.FLEET)
        ),
        mean_queue_s=mean(metrics.QUEUE_TIME_SECONDS),
        mean_prefill_s=mean(metrics.PREFILL_TIME_SECONDS),
        mean_prompt_tokens=mean(metrics.REQUEST_PROMPT_TOKENS),
        mean_output_tokens=mean(metrics.REQUEST_GENERATION_TOKENS),
        lifetime_mean_prompt_tokens=lifetime_mean(metrics.REQUEST_PROMPT_TOKENS),
        lifetime_mean_output_tokens=lifetime_mean(metrics.REQUEST_GENERATION_TOKENS),
        running=scalar(promql.requests_running(sel, promql.FLEET)) or 0.0,
        waiting=scalar(promql.requests_waiting(sel, promql.FLEET)) or 0.0,
        peaks=peaks,
    )
    labels = {k: v for k, v in engines[0]["metric"].items() if k != "__name__"}
    samples = [metrics.Sample(metrics.CACHE_CONFIG_INFO, labels, 1.0)]
    named = _query(client, url, f"count by (model_name) ({sel.of(metrics.REQUESTS_RUNNING)})")
    model = str(named[0]["metric"]["model_name"]) if named and "model_name" in named[0]["metric"] else None
    return Observation(
        facts,
        labels,
        doctor.capacity_of(samples),
        model,
        "read through Prometheus, which does not say where the model's files are: pass --model DIR",
        notes=notes,
    )


# ---- the model's KV bytes per token ----------------------------------------------------------------------


def model_geometry(model: str | None, why: str) -> tuple[kv_math.ModelGeometry | None, str]:
    """The model's geometry from a known name or a local directory's config.json, or why not."""
    if model is None:
        return None, why
    geometry = kv_math.lookup_geometry(model)
    if geometry is not None:
        return geometry, ""
    if Path(model).is_dir():
        return None, f"{model}/config.json lacks the layer, head and hidden sizes; pass --model DIR"
    return None, why or (
        f"the engine serves {model!r}, which is not a directory with config.json on this machine "
        "nor a model kvtune knows; pass --model DIR"
    )


# ---- the command -----------------------------------------------------------------------------------------


def render(url: str, observation: Observation, findings: list[doctor.Finding]) -> str:
    facts = observation.facts
    warnings = sum(finding.level == "warn" for finding in findings)
    verdict = "healthy" if not warnings else f"unhealthy ({warnings} warning{'s' * (warnings > 1)})"
    early = " (ended early)" if observation.ended_early else ""
    lines = [f"kvtune doctor {url}: {facts.seconds:.0f} s window{early}: {verdict}"]
    lines += [f"  note: {note}" for note in observation.notes]
    for finding in findings:
        tag = "WARN" if finding.level == "warn" else "ok  "
        lines.append(f"  {tag} {finding.check}: {finding.text}")
        lines += [f"         {line}" for line in finding.arithmetic.splitlines()]
    return "\n".join(lines)


def _observe(args: argparse.Namespace, url: str, client: httpx.Client, console: Console) -> Observation:
    if args.prometheus:
        return read_prometheus(client, url, args.window, args.selector)
    columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"watching {url} (Ctrl-C ends the window)", total=args.window)
        with stop_requested_by_signals() as stop:
            return watch_engine(
                client,
                url,
                args.window,
                wait=stop.wait,
                on_tick=lambda elapsed: progress.update(task, completed=elapsed),
            )


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    try:
        url = base_url(args.url)
        if not args.window > 0:
            raise UsageError(f"--window {args.window:g}: give a positive number of seconds, e.g. 30")
        if not args.ttft_slo > 0:
            raise UsageError(f"--ttft-slo {args.ttft_slo:g}: give a positive number of seconds, e.g. 2")
        key = api_key(args.api_key_env)
    except UsageError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False)
        return ExitCode.CONFIG
    with client_for(key.get_secret_value() if key else None, timeout=10.0) as client:
        try:
            observation = _observe(args, url, client, console)
        except ReadError as exc:
            console.print(f"error: {exc}", markup=False, highlight=False)
            return ExitCode.CONFIG
    model, why = (args.model, "") if args.model else (observation.model, observation.why_no_model)
    geometry, why = model_geometry(model, why)
    kv = doctor.resolve_kv_bytes(observation.cache, geometry, why)
    findings = doctor.diagnose(observation.facts, observation.capacity, observation.cache, kv, args.ttft_slo)
    if args.json:
        source = "prometheus" if args.prometheus else "engine"
        data = doctor.report(source, observation.facts, observation.capacity, findings)
        data |= {"url": url, "ended_early": observation.ended_early, "notes": observation.notes}
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        Console(soft_wrap=True).print(render(url, observation, findings), markup=False, highlight=False)
    return ExitCode.OK if doctor.healthy(findings) else ExitCode.FAILED
