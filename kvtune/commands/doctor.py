"""`kvtune doctor URL`: read a running vLLM engine's own counters over a window and say what ails it.

The engine's /metrics is scraped at the start and the end of the window, and its gauges every second in
between (Ctrl-C ends the window early); with `--prometheus`, URL is a Prometheus server that already holds
the same series, queried over the last window. The judging is `kvtune.observability.doctor`'s.
Exit codes: 0 healthy, 1 a warning, 2 the engine (or Prometheus) cannot be read, or reports numbers no
single engine can (hits above queries, a usage above 100%, buckets that go down, a negative count, a series
twice: `kvtune.metrics.impossible`), where no verdict would mean anything.

vLLM's /metrics (0.32.0: `vllm:cache_config_info` carries CacheConfig's fields only; no gauge carries the
ParallelConfig) does not say how many GPUs share the model, so `--tensor-parallel-size` and
`--pipeline-parallel-size` say it; the KV bytes are then one GPU's, as vLLM's num_gpu_blocks and
kv_cache_memory_bytes are. A pool whose own bytes per token disagree with the sizes given is pointed out.

Every call goes through kvtune's HTTP policy (`kvtune.http_client`) within `--timeout`, which also bounds
the run: no call takes longer, and the doctor ends within --window plus --timeout (with --prometheus, within
--timeout), so a server that stalls, floods or lies ends it with one line instead of hanging it. What the
servers answer is checked for its shape before it is judged, and `--selector` is parsed as label matchers
and rendered escaped (`promql.parse_selector`), never pasted into a query.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from kvtune import http_client, kv_math, metrics, metrics_window
from kvtune.commands.common import ExitCode, positive_count, seconds_at_most, stop_requested_by_signals
from kvtune.commands.load import UsageError, api_key
from kvtune.credentials import name_may_be_shown, not_a_variable_name
from kvtune.http_client import json_kind, shown_url
from kvtune.observability import doctor, promql, trace_advice
from kvtune.openai_client import auth_headers
from kvtune.server_url import ServerUrlError, server_url
from kvtune.traces.analysis import DEFAULT_TARGET_SHARE, trace_curve
from kvtune.traces.format import Trace, read_trace
from kvtune.traces.tokens import BlockMapping

SAMPLE_EVERY_S = 1.0
DEFAULT_WINDOW_S = 30.0
# A day: longer windows are Prometheus' job (--prometheus), and a bound keeps the arithmetic finite.
MAX_WINDOW_S = 86_400.0
MAX_TIMEOUT_S = 600.0
# A model root longer than this is no path on this machine (PATH_MAX is 4096 on Linux).
_MAX_ROOT = 4096
# The pool's own bytes per token (kv_cache_memory_bytes over its tokens) may exceed the model's by this
# share before the parallel sizes given are doubted: whole blocks only round the pool down.
_SIZES_MATCH = 0.1


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
        type=seconds_at_most(MAX_WINDOW_S, "a day"),
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
        "--timeout",
        type=seconds_at_most(MAX_TIMEOUT_S),
        default=http_client.DEADLINE_S,
        metavar="SECONDS",
        help="seconds the doctor waits for the engine (or Prometheus): no answer, whole body included, takes "
        "longer, and the doctor ends within --window plus SECONDS (with --prometheus: within SECONDS) "
        "(default %(default)g)",
    )
    parser.add_argument(
        "--prometheus", action="store_true", help="URL is a Prometheus server that scrapes the engine"
    )
    parser.add_argument(
        "--selector",
        default="",
        metavar="MATCHERS",
        help='with --prometheus: label matchers naming one engine, e.g. \'job="vllm", instance="a:8000"\' '
        "(=, !=, =~ or !~, quoted values, comma separated)",
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
        type=seconds_at_most(MAX_WINDOW_S, "a day"),
        default=doctor.DEFAULT_TTFT_P99_S,
        metavar="SECONDS",
        help="P99 time to first token, seconds, above which TTFT is a warning (default %(default)g)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=positive_count,
        default=1,
        metavar="N",
        help="the engine's tensor-parallel size: KV bytes are then one GPU's share (vLLM's metrics do not "
        "say it) (default %(default)s)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        type=positive_count,
        default=1,
        metavar="N",
        help="the engine's pipeline-parallel size: KV bytes are then one GPU's share (vLLM's metrics do not "
        "say it) (default %(default)s)",
    )
    traffic = parser.add_argument_group("the traffic the engine serves, as a trace (kvtune trace)")
    traffic.add_argument(
        "--trace",
        type=Path,
        help="a hash-block trace of the engine's traffic: the pool is judged by its hit-rate curve (the "
        "smallest pool reaching 95%% of its ideal hit rate), which then sizes the pool for every check",
    )
    traffic.add_argument(
        "--trace-block-size",
        type=positive_count,
        help="tokens per hash id in the trace (default: the lines' own block_size, else 512)",
    )
    traffic.add_argument(
        "--tokens-per-block",
        type=positive_count,
        help="engine tokens per trace block, a multiple of the engine's block size "
        "(default: one engine block)",
    )
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


# ---- reading the engine --------------------------------------------------------------------------------


@dataclass
class Observation:
    """What a reader saw: the window's facts, the pool's labels and where the model's config may be."""

    facts: metrics_window.WindowFacts
    cache: dict[str, str]
    capacity: metrics.KvCapacity | None
    model: str | None = None
    why_no_model: str = ""
    ended_early: bool = False
    notes: list[str] = field(default_factory=list)
    pool_problems: list[str] = field(default_factory=list)


def base_url(url: str, prometheus: bool = False) -> str:
    """URL without a trailing slash or `/metrics`; UsageError unless it is an http(s) base URL with a host
    (`server_url`). A password in it is sent (as Basic auth) but never shown."""
    example = "http://127.0.0.1:9090" if prometheus else "http://127.0.0.1:8000"
    try:
        return server_url(url, example).removesuffix("/metrics").rstrip("/")
    except ServerUrlError as exc:
        raise UsageError(f"URL {exc}") from None


def selector(matchers: str) -> promql.Selector:
    """--selector parsed as label matchers, rendered escaped; UsageError naming the flag otherwise."""
    try:
        return promql.parse_selector(matchers)
    except promql.SelectorError as exc:
        raise UsageError(f"--selector {exc}") from None


def key_from_env(name: str | None) -> SecretStr | None:
    """The engine's API key from the variable `name` (else KVTUNE_API_KEY when set).

    A value that cannot be a variable's name may be the key itself, pasted where its name belongs: it is
    refused without being shown."""
    if name is not None and not_a_variable_name(name):
        raise UsageError(
            "--api-key-env takes the NAME of a variable holding the key, e.g. VLLM_API_KEY; the value "
            "given is not a variable name"
        )
    if name is not None and not name_may_be_shown(name) and name not in os.environ:
        raise UsageError(
            "--api-key-env: the variable named is not set (its name is not shown: it may be the key "
            "itself); export the key in a variable such as VLLM_API_KEY and give that name"
        )
    return api_key(name)


@dataclass
class Reader:
    """The doctor's HTTP client, the deadline of each call (`--timeout`) and the run's (`run_s` from its
    first call on): a call gets whichever leaves less time, so no call outlives the run."""

    client: httpx.Client
    timeout_s: float = http_client.DEADLINE_S
    run_s: float = math.inf
    _ends_at: float | None = field(default=None, init=False)

    def deadline_s(self) -> float:
        """Seconds the next call may take."""
        now = time.monotonic()
        if self._ends_at is None:
            self._ends_at = now + self.run_s
        return min(self.timeout_s, self._ends_at - now)

    def get(self, url: str, what: str, fix: str, params: dict[str, str] | None = None) -> httpx.Response:
        """A 200 answer from `url`, read whole within the deadline and the size cap; ReadError otherwise."""
        response = self.answer(url, what, fix, params)
        if response.status_code != 200:
            raise ReadError(
                f"{shown_url(url)} answered HTTP {response.status_code}: check that URL is {what}'s base URL "
                f"({fix})"
            )
        return response

    def answer(self, url: str, what: str, fix: str, params: dict[str, str] | None = None) -> httpx.Response:
        """Any answer but a redirect or a refused key, read whole within the bounds; ReadError otherwise."""
        shown = shown_url(url)
        deadline_s = self.deadline_s()
        # What ran out when time did: the call's own --timeout, or what the run had left of it.
        run_out = f"the run's --timeout {self.timeout_s:g} s ran out"
        if deadline_s <= 0:
            raise ReadError(f"{shown} was not asked: {run_out} (the calls before it took it all); {fix}")
        started = time.monotonic()
        try:
            response = http_client.get(self.client, url, params=params, deadline_s=deadline_s)
        except httpx.ConnectTimeout:
            connect_s = min(deadline_s, http_client.CONNECT_TIMEOUT_S)
            raise ReadError(f"cannot reach {shown}: no connection within {connect_s:g} s; {fix}") from None
        except httpx.TimeoutException:
            within = (
                f"within --timeout {self.timeout_s:g} s"
                if deadline_s >= self.timeout_s
                else f"before {run_out}"
            )
            raise ReadError(f"{shown} did not answer {within}; {fix}, or raise --timeout") from None
        except http_client.LimitExceeded as exc:  # too slow or too big
            if deadline_s < self.timeout_s and time.monotonic() - started >= deadline_s:
                raise ReadError(
                    f"{shown} was still answering when {run_out}; {fix}, or raise --timeout"
                ) from None
            raise ReadError(f"{exc}: check that URL is {what}'s base URL") from None
        except httpx.DecodingError as exc:  # mis-encoded
            raise ReadError(f"{exc}: check that URL is {what}'s base URL") from None
        except httpx.HTTPError as exc:
            raise ReadError(f"cannot reach {shown} ({exc.__class__.__name__}: {exc}); {fix}") from None
        if response.status_code in (401, 403):
            raise ReadError(
                f"{shown} answered HTTP {response.status_code}: {what} needs an API key; "
                "pass it with --api-key-env NAME"
            )
        if response.is_redirect:
            location = shown_url(response.headers.get("location", "?"))[:200]
            raise ReadError(
                f"{shown} answered HTTP {response.status_code}, a redirect to {location!r}, which the doctor "
                "does not follow (the API key would go along): give the URL it points to"
            )
        return response


def scrape(reader: Reader, url: str) -> metrics.Exposition:
    """One scrape of a vLLM engine's /metrics; ReadError when it is not one."""
    target = f"{url}/metrics"
    shown = shown_url(target)
    response = reader.get(target, "a vLLM engine", "start the engine, or check the host and port")
    fix = "give a vLLM server's base URL (or a Prometheus server's, with --prometheus)"
    try:
        exposition = metrics.read_exposition(response.content.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ReadError(
            f"{shown} is not a vLLM engine's /metrics (not UTF-8 text: byte {exc.start}); {fix}"
        ) from None
    except metrics.ImpossibleMetrics as exc:
        raise impossible(shown, str(exc)) from None
    except metrics.ExpositionError as exc:
        raise ReadError(f"{shown} is not a vLLM engine's /metrics ({exc}); {fix}") from None
    if not any(sample.name.startswith("vllm:") for sample in exposition.samples):
        skipped = f" ({exposition.skipped_text()})" if exposition.skipped else ""
        raise ReadError(
            f"{shown} has no vllm: metrics{skipped}: {shown_url(url)} is not a vLLM engine; {fix}"
        )
    return exposition


def impossible(shown: str, why: str, prometheus: bool = False) -> ReadError:
    """The doctor's refusal of numbers no single engine exports together (`metrics.impossible`)."""
    fix = (
        "check that --selector matches one engine's series"
        if prometheus
        else "check that URL points at one vLLM engine (not a proxy or exporter that merges or rewrites them)"
    )
    return ReadError(f"{shown}: {why}; {fix}")


def served_model(reader: Reader, url: str) -> tuple[str | None, str]:
    """Where the engine's model lives (its /v1/models `root`, else its name), or why it is unknown."""
    target = f"{url}/v1/models"
    shown = shown_url(target)
    try:
        response = reader.get(target, "an OpenAI-compatible server", "pass --model DIR")
    except ReadError as exc:
        return None, str(exc) if "--model DIR" in str(exc) else f"{exc}; or pass --model DIR"
    try:
        body = http_client.strict_json(response)
    except http_client.NotJson as exc:
        return None, f"{shown} did not answer JSON ({exc}); pass --model DIR"
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list):
        return None, f"{shown} answered {json_kind(body)}, not an object with a 'data' list; pass --model DIR"
    entry = next((m for m in models if isinstance(m, dict) and not m.get("parent")), None)
    if entry is None:
        return None, f"{shown} lists no model; pass --model DIR"
    root = entry.get("root") or entry.get("id")
    if not isinstance(root, str) or not root or len(root) > _MAX_ROOT or "\0" in root:
        return None, f"{shown} lists a model whose root and id are not a usable name; pass --model DIR"
    return root, ""


def watch_engine(
    reader: Reader,
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
    first = scrape(reader, url)
    skipped = dict(first.skipped)
    peaks = metrics_window.Peaks()
    peaks.update(first.samples)
    start = clock()
    deadline = start + window_s
    last, ended_early = first, False
    while (now := clock()) < deadline:
        ended_early = wait(min(SAMPLE_EVERY_S, deadline - now))
        last = scrape(reader, url)
        for name, why in last.skipped.items():
            skipped.setdefault(name, why)
        peaks.update(last.samples)
        if ended_early:
            break
        on_tick(clock() - start)
    seconds = clock() - start
    model, why = served_model(reader, url)
    facts = metrics_window.from_snapshots(first.samples, last.samples, peaks, seconds, skipped)
    if facts.impossible:
        raise impossible(f"{shown_url(url)}/metrics", facts.impossible)
    capacity, cache, problems = doctor.pool_of(last.samples)
    notes = []
    if skipped:
        worst = max((first, last), key=lambda scraped: scraped.skipped_count)
        notes.append(f"engine's /metrics: {worst.skipped_text()}")
    notes += [f"engine's /metrics: {problem}" for problem in problems]
    return Observation(facts, cache, capacity, model, why, ended_early, notes, problems)


# ---- reading Prometheus --------------------------------------------------------------------------------


def _query(reader: Reader, url: str, expr: str, at: float | None = None) -> list[dict[str, Any]]:
    """An instant query's vector result (evaluated AT a Unix time, else now), [] when no series matched;
    each item checked to be a sample ({"metric": {str: str}, "value": [time, "number"]}), so a server that
    is not Prometheus is one line."""
    target = f"{url}/api/v1/query"
    shown = shown_url(target)
    fix = "start Prometheus, or check the host and port"
    params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
    response = reader.answer(target, "a Prometheus server", fix, params=params)

    def not_prometheus(what: str) -> ReadError:
        return ReadError(
            f"{shown} answered HTTP {response.status_code}, {what}, not as Prometheus' HTTP API: give a "
            "Prometheus server's base URL, e.g. http://127.0.0.1:9090 (or drop --prometheus for an engine)"
        )

    try:
        body = http_client.strict_json(response)
    except http_client.NotJson as exc:
        raise not_prometheus(f"not JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("status") not in ("success", "error"):
        raise not_prometheus(f"{json_kind(body)} without a status")
    if body["status"] != "success":
        error = str(body.get("error", "?"))[:200]
        raise ReadError(f"{shown} refused the query ({error}): check --selector; query: {expr}")
    data = body.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise not_prometheus("a success whose data is not an instant vector")
    result = data.get("result")
    if not isinstance(result, list) or not all(_is_sample(item) for item in result):
        raise not_prometheus("a vector whose result is not a list of samples")
    return result


def _is_sample(item: object) -> bool:
    if not isinstance(item, dict):
        return False
    labels, value = item.get("metric"), item.get("value")
    return (
        isinstance(labels, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items())
        and isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], int | float)
        and not isinstance(value[0], bool)
        and math.isfinite(value[0])
        and isinstance(value[1], str)
    )


def read_prometheus(reader: Reader, url: str, window_s: float, sel: promql.Selector) -> Observation:
    """The same facts as `watch_engine`, over the last window, from a Prometheus server's HTTP API. Every
    query is evaluated at the time the first was, so all of them read the same samples (two evaluated a
    scrape apart could show hits growing faster than queries)."""
    engines = _query(reader, url, promql.cache_config_info(sel))
    shown = f"--selector {', '.join(sel.matchers)}" if sel.matchers else "no --selector"
    if not engines:
        raise ReadError(
            f"{shown_url(url)} has no {metrics.CACHE_CONFIG_INFO} series ({shown}): check that Prometheus "
            "scrapes the engine and that --selector matches it"
        )
    # One vLLM server with several engine cores (data parallel) exports one series per core.
    servers = sorted({(e["metric"].get("job", "?"), e["metric"].get("instance", "?")) for e in engines})
    if len(servers) > 1:
        found = ", ".join(f'instance="{instance[:80]}"' for _job, instance in servers[:5])
        raise ReadError(
            f"{shown_url(url)}: {len(servers)} engines match ({shown}): {found}; the doctor reads one: "
            "narrow --selector, e.g. --selector 'instance=\"host:8000\"'"
        )

    at = float(engines[0]["value"][0])

    def query(expr: str) -> list[tuple[dict[str, str], str]]:
        return [(item["metric"], item["value"][1]) for item in _query(reader, url, expr, at)]

    readings = metrics_window.promql_readings(query, sel.of, window_s)
    facts = metrics_window.WindowFacts.of(readings)
    if facts.impossible:
        raise impossible(f"{shown_url(url)}'s answers ({shown})", facts.impossible, prometheus=True)
    notes = []
    skipped = readings.skipped
    if metrics.PREFIX_CACHE_QUERIES not in readings.increases and metrics.PREFIX_CACHE_QUERIES not in skipped:
        notes.append(
            f"Prometheus holds too few samples in the last {max(round(window_s), 1)}s to compute increases: "
            "widen --window to several scrape intervals"
        )
    if skipped:
        reasons = "; ".join(f"{name} {why}" for name, why in list(skipped.items())[:3])
        notes.append(f"Prometheus' answers: {len(skipped)} left out: {reasons}")
    labels = {k: v for k, v in engines[0]["metric"].items() if k != "__name__"}
    capacity, cache, problems = doctor.pool_of([metrics.Sample(metrics.CACHE_CONFIG_INFO, labels, 1.0)])
    notes += [f"Prometheus' answers: {problem}" for problem in problems]
    named = _query(reader, url, f"count by (model_name) ({sel.of(metrics.REQUESTS_RUNNING)})", at)
    model = named[0]["metric"].get("model_name") if named else None
    return Observation(
        facts,
        cache,
        capacity,
        model,
        "read through Prometheus, which does not say where the model's files are: pass --model DIR",
        notes=notes,
        pool_problems=problems,
    )


# ---- the model's KV bytes per token ----------------------------------------------------------------------


def model_geometry(model: str | None, why: str) -> tuple[kv_math.ModelGeometry | None, str]:
    """The model's geometry from a known name or a local directory's config.json, or why not."""
    if model is None:
        return None, why
    geometry = kv_math.lookup_geometry(model)
    if geometry is not None:
        return geometry, ""
    try:
        is_dir = Path(model).is_dir()
    except (OSError, ValueError):  # a name too long for a path, or with a NUL in it
        is_dir = False
    if is_dir:
        return None, f"{model}/config.json lacks the layer, head and hidden sizes; pass --model DIR"
    return None, why or (
        f"the engine serves {model[:120]!r}, which is not a directory with config.json on this machine "
        "nor a model kvtune knows; pass --model DIR"
    )


def parallel_problem(geometry: kv_math.ModelGeometry | None, tp: int, pp: int) -> str | None:
    """Why the engine cannot be split TP x PP ways (vLLM would not have started so): the flags are wrong."""
    problem = None if geometry is None else geometry.parallel_problem(tp, pp)
    if problem is None:
        return None
    return f"--tensor-parallel-size {tp} --pipeline-parallel-size {pp} cannot be the engine's: {problem}"


def sizes_doubt(cache: dict[str, str], kv: kv_math.KvBytes, tp: int, pp: int) -> str | None:
    """The pool's own bytes per token (its explicit kv_cache_memory_bytes, one GPU's, over its tokens) set
    against the model's at the parallel sizes given; why the sizes look wrong, else None."""
    memory = kv_math.label_int(cache, "kv_cache_memory_bytes")
    blocks, block_size = kv_math.label_int(cache, "num_gpu_blocks"), kv_math.label_int(cache, "block_size")
    if kv.per_token is None or not (memory and blocks and block_size):
        return None
    if kv_math.label_int(cache, "num_gpu_blocks_override") is not None:  # the cap sized it, not the bytes
        return None
    tokens = blocks * block_size
    pool_per_token = memory // tokens
    if abs(pool_per_token - kv.per_token) <= _SIZES_MATCH * kv.per_token:
        return None
    sizes = doctor.per_gpu_basis(tp, pp) or "on one GPU"
    return (
        f"the engine's pool holds ~{pool_per_token:,} bytes/token per GPU (kv_cache_memory_bytes "
        f"{memory:,} / {tokens:,} tokens) but the model {sizes} needs {kv.per_token:,} "
        f"(~{kv.per_token / pool_per_token:.1f}x): vLLM's metrics do not say its parallel sizes; check "
        "--tensor-parallel-size and --pipeline-parallel-size"
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


def _observe(args: argparse.Namespace, url: str, reader: Reader, console: Console) -> Observation:
    if args.prometheus:
        return read_prometheus(reader, url, args.window, selector(args.selector))
    columns = (TextColumn("{task.description}"), BarColumn(), TimeRemainingColumn())
    # Off when stderr is no terminal: a transient bar still leaves a blank line before the report there.
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"watching {shown_url(url)} (Ctrl-C ends the window)", total=args.window)
        with stop_requested_by_signals() as stop:
            return watch_engine(
                reader,
                url,
                args.window,
                wait=stop.wait,
                on_tick=lambda elapsed: progress.update(task, completed=elapsed),
            )


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True, soft_wrap=True)
    try:
        url = base_url(args.url, args.prometheus)
        key = key_from_env(args.api_key_env)
        conflict = http_client.credential_conflict(
            url, key is not None, key_name="an API key (--api-key-env)"
        )
        if conflict:
            raise UsageError(conflict)
        if args.selector and not args.prometheus:
            raise UsageError("--selector picks an engine's series in Prometheus: give it with --prometheus")
        selector(args.selector)  # refused before anything is asked
    except UsageError as exc:
        console.print(f"error: {exc}", markup=False, highlight=False)
        return ExitCode.CONFIG
    # A bad trace is refused before the window is waited for (ConfigError: exit 2, its line named).
    trace = read_trace(args.trace, args.trace_block_size) if args.trace is not None else None
    with http_client.new_client(auth_headers(key.get_secret_value() if key else None)) as client:
        # A read may wait as long as the call's deadline: a shorter socket timeout would end a silent
        # server's call early, under a message naming a --timeout it did not wait.
        client.timeout = httpx.Timeout(args.timeout, connect=http_client.CONNECT_TIMEOUT_S)
        # The window is waited for on purpose; the servers' answers, all together, within --timeout.
        reader = Reader(client, args.timeout, args.timeout + (0.0 if args.prometheus else args.window))
        try:
            observation = _observe(args, url, reader, console)
        except ReadError as exc:
            console.print(f"error: {exc}", markup=False, highlight=False)
            return ExitCode.CONFIG
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    model, why = (args.model, "") if args.model else (observation.model, observation.why_no_model)
    geometry, why = model_geometry(model, why)
    problem = parallel_problem(geometry, tp, pp)
    if problem:
        console.print(f"error: {problem}", markup=False, highlight=False)
        return ExitCode.CONFIG
    kv = kv_math.resolve_kv_bytes(observation.cache, geometry, why, tp, pp)
    doubt = sizes_doubt(observation.cache, kv, tp, pp)
    observation.notes += [doubt] if doubt else []
    for note in observation.notes:  # the report goes to stdout; what limits it is said on stderr too
        console.print(f"warning: {note}", markup=False, highlight=False)
    findings = doctor.diagnose(
        observation.facts,
        observation.capacity,
        observation.cache,
        kv,
        args.ttft_slo,
        observation.pool_problems,
        doctor.per_gpu_basis(tp, pp),
        curve=_curve_check(trace, args, observation, kv, doctor.per_gpu_basis(tp, pp)),
    )
    shown = shown_url(url)
    if args.json:
        source = "prometheus" if args.prometheus else "engine"
        data = doctor.report(source, observation.facts, observation.capacity, findings)
        data |= {"url": shown, "ended_early": observation.ended_early, "notes": observation.notes}
        data |= {"parallel": {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}}
        sys.stdout.write(json.dumps(data, indent=2, allow_nan=False) + "\n")
    else:
        Console(soft_wrap=True).print(render(shown, observation, findings), markup=False, highlight=False)
    return ExitCode.OK if doctor.healthy(findings) else ExitCode.FAILED


def _curve_check(
    trace: Trace | None, args: argparse.Namespace, observation: Observation, kv: kv_math.KvBytes, basis: str
) -> Callable[[metrics_window.WindowFacts], doctor.Finding | None] | None:
    """The pool judged by the trace's curve in the engine's own blocks (None without a trace or a pool)."""
    capacity = observation.capacity
    if trace is None or capacity is None:
        return None
    block = capacity.block_size
    mapping = BlockMapping(trace.block_size, args.tokens_per_block or block, block)
    curve = trace_curve(trace, mapping).curve
    source = Path(trace.source).name

    def judge(facts: metrics_window.WindowFacts) -> doctor.Finding:
        measured = None if {"hits", "queries"} & set(facts.unknown) else facts.hit_rate
        return trace_advice.judge(
            curve, source, DEFAULT_TARGET_SHARE, capacity, observation.cache, kv, measured, basis
        )

    return judge
