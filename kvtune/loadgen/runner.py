"""Run a workload against an engine with Locust, headless, and return a typed result.

Locust runs in its own processes (one, or a master and workers on loopback): importing it patches a process
for gevent, and the caller (the sweep) also runs engines and threads. The Locust users write one JSON line per
request; this module reads them, keeps the measured window (warm-up excluded) and adds the engine's own
metric deltas over that window. A workload with an end (a trace) ends the run when its requests are
answered, not a fixed duration later.

The Locust files ship inside the package (kvtune.loadgen.locustfiles), so a wheel install runs them. An
engine's API key (KVTUNE_API_KEY) and URL (LOCUST_HOST: it may hold a password) reach the Locust processes
only through their environment, never their command line. Before any Locust process starts, the URL must
answer as a vLLM server; every read of it is bounded in time and size (kvtune.http_client).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvtune import http_client, metrics, metrics_window
from kvtune.engine import free_port
from kvtune.files import write_atomic
from kvtune.http_client import shown_url
from kvtune.loadgen.completions import shown_text
from kvtune.loadgen.locustfiles import locustfile
from kvtune.loadgen.pacing import Arrival, schedule_for
from kvtune.loadgen.results import (
    READ_METRICS,
    LatencySamples,
    Lateness,
    LoadResult,
    Percentiles,
    TraceCuts,
    engine_deltas,
    trend,
)
from kvtune.loadgen.samples import count_lines, read_samples
from kvtune.loadgen.trace_workload import TraceArgs, trace_arrivals
from kvtune.loadgen.workload_args import (
    API_KEY_ENV,
    DEFAULT_MAX_TOKENS,
    MOST_MAX_TOKENS,
    MOST_RATE,
    MOST_USERS,
    MOST_WORKERS,
    STOP_FILE,
    WorkloadError,
    WorkloadName,
    default_arrival,
    validate_workload_args,
)
from kvtune.processes import stop_groups

log = logging.getLogger(__name__)

STARTED_SUFFIX = ".started"
# Locust reads its --host from here: the URL may hold a password, and a command line is public (`ps`).
LOCUST_HOST_ENV = "LOCUST_HOST"
# A vLLM engine answers its model list and metrics in milliseconds; a server still sending after this
# long is stalling (http_client bounds each read at its READ_TIMEOUT_S as well).
CHECK_DEADLINE_S = 10.0
# A vLLM engine's /metrics is ~50 KB; the exposition parser takes ~0.6 s a MiB, so a scrape is capped well
# below the general policy's cap.
METRICS_MAX_BYTES = 4 * 2**20
# The measured window and the unmeasured load before it, unless the spec says; a trace has no fixed window
# (its requests are all measured: none is warm-up).
DEFAULT_DURATION_S = 30.0
DEFAULT_WARMUP_S = 5.0
# With measured_requests, how many times duration_s the window may grow to reach its count: generous, so a
# host several times slower gives the same sample, later.
MEASURED_PATIENCE = 10.0
# Past the Locust users' own bound on requests in flight, time for them to write their last samples.
_DRAIN_MARGIN_S = 15.0
# The end of a failed Locust process's log holds its reason; the rest is not read.
_LOG_TAIL_BYTES = 64 * 1024
# Each Locust process's output file, by pid, to quote its error when it exits early.
_LOGS: dict[int, Path] = {}


class LoadTestError(RuntimeError):
    """The load test could not run (bad input, unreachable host); str() says why and how to fix it."""


class ServerError(LoadTestError):
    """The URL does not answer as a vLLM server (unreachable, needs a key, not OpenAI, no metrics)."""


class LoadSpec(BaseModel):
    """What to run: workload W at load L for T seconds against URL (a trace: until its requests are
    answered, unless T caps it)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="engine base URL, e.g. http://127.0.0.1:8000")
    workload: WorkloadName = "shared_prefix"
    workload_args: dict[str, str | int | float] = Field(
        default_factory=dict, description="the workload's own flags, e.g. {'prefix-reuse': 0.5}"
    )
    model: str = Field("", description="served model name; default: the first the server lists")
    users: int = Field(
        4,
        ge=1,
        le=MOST_USERS,
        description="closed loop: concurrent users; open loop: most requests in flight",
    )
    arrival: Arrival = Field(
        "closed",
        description="closed loop; open loop at `rate` (constant, poisson) or at a trace's own times (trace); "
        "default: the workload's own (closed; a trace: trace)",
    )
    rate: float | None = Field(
        None, gt=0, le=MOST_RATE, description="open-loop arrival rate, requests per second"
    )
    duration_s: float | None = Field(
        DEFAULT_DURATION_S,
        gt=0,
        description=f"measured window (default {DEFAULT_DURATION_S:g} s); a trace: at most this long "
        "(default: until its requests are answered)",
    )
    warmup_s: float = Field(
        DEFAULT_WARMUP_S,
        ge=0,
        description="load before the window, excluded from results "
        f"(default {DEFAULT_WARMUP_S:g} s; a trace: 0)",
    )
    measured_requests: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="the window holds at least this many answered requests: past duration_s it stays open "
        f"until they are in (up to {MEASURED_PATIENCE:g}x duration_s), so a slower host gives the same "
        "sample, later",
    )
    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, ge=1, le=MOST_MAX_TOKENS, description="output tokens per request"
    )
    ignore_eos: bool = Field(False, description="always generate max_tokens (fixed output length)")
    workers: int = Field(
        0, ge=0, le=MOST_WORKERS, description="0: one Locust process; N: a master and N workers on loopback"
    )
    seed: int = 0
    request_timeout_s: float = Field(600.0, gt=0)
    api_key: SecretStr | None = Field(
        None,
        exclude=True,
        description=f"the engine's API key; Locust gets it in {API_KEY_ENV} only, never on its command line",
    )

    @model_validator(mode="before")
    @classmethod
    def _the_workloads_own_defaults(cls, data: Any) -> Any:
        """Arrival, window and warm-up left unset (or None) take the workload's own: a trace arrives at its
        own times, runs to its end and is measured whole."""
        if not isinstance(data, dict):
            return data
        workload = data.get("workload", "shared_prefix")
        trace = workload == "trace"
        defaults = {
            "arrival": default_arrival(workload if isinstance(workload, str) else ""),
            "duration_s": None if trace else DEFAULT_DURATION_S,
            "warmup_s": 0.0 if trace else DEFAULT_WARMUP_S,
        }
        given = {key: value for key, value in data.items() if value is not None or key not in defaults}
        return defaults | given

    @model_validator(mode="after")
    def _workload_args_are_the_workloads(self) -> Self:
        try:
            self.workload_args = validate_workload_args(self.workload, self.workload_args)
        except WorkloadError as exc:
            raise ValueError(f"workload_args: {exc}") from None
        if self.arrival == "trace" and self.workload != "trace":
            raise ValueError(
                "arrival: 'trace' keeps a trace's own arrival times; use workload trace, or arrival closed, "
                "constant or poisson"
            )
        if self.measured_requests is not None and self.duration_s is None:
            raise ValueError(
                "measured_requests: a trace run to its end measures every request; set duration_s to cap it"
            )
        if self.workload == "trace" and self.workers:
            raise ValueError(
                f"workers: {self.workers}, but a trace is one sequence of requests, replayed by one Locust "
                "process; use workers 0 (users bound the requests in flight)"
            )
        return self

    @property
    def ends_by_itself(self) -> bool:
        """The workload has an end (a trace), and no duration cuts it short."""
        return self.workload == "trace" and self.duration_s is None

    @property
    def run_seconds(self) -> float | None:
        """Warm-up and the longest window; None when the workload's end ends the run."""
        longest = self.longest_window_s
        return None if longest is None else self.warmup_s + longest

    @property
    def longest_window_s(self) -> float | None:
        """The window's length, or with measured_requests the most it may grow to; None: no fixed window."""
        if self.duration_s is None:
            return None
        return self.duration_s * (1.0 if self.measured_requests is None else MEASURED_PATIENCE)

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"} if self.api_key else {}

    def locust_env(self) -> dict[str, str]:
        """The Locust processes' environment: the caller's, with the URL and the API key (set or removed) by
        this spec. The URL goes here, not on the command line: it may hold a password (http://u:p@host)."""
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
        env[LOCUST_HOST_ENV] = self.url
        if self.api_key is not None:
            env[API_KEY_ENV] = self.api_key.get_secret_value()
        return env

    def locust_args(self, samples: Path) -> list[str]:
        args = [
            "--samples-file",
            str(samples),
            "--max-tokens",
            str(self.max_tokens),
            "--seed",
            str(self.seed),
            "--arrival",
            self.arrival,
            "--request-timeout",
            str(self.request_timeout_s),
            "--run-for",
            str(self.run_seconds or 0),
            "--finish-within",
            str(_stop_timeout(self)),
        ]
        if self.model:
            args += ["--model", self.model]
        if self.ignore_eos:
            args.append("--ignore-eos")
        if self.arrival in ("constant", "poisson"):
            if self.rate is None:
                raise LoadTestError("open-loop arrival needs a rate; set rate (requests per second)")
            args += ["--arrival-rate", str(self.rate / max(self.workers, 1))]
        for flag, value in self.workload_args.items():
            args += [f"--{flag}", str(value)]
        return args


def run_load(
    spec: LoadSpec,
    *,
    log_dir: Path | None = None,
    on_progress: Callable[[float], None] | None = None,
    scrape_interval: float = 1.0,
) -> LoadResult:
    """Run `spec` and return its result; raises LoadTestError for bad input or an unreachable engine.

    With `log_dir`, the per-request samples and Locust's logs stay there (a new folder per run).
    """
    arrivals = _trace_arrivals(spec)  # a bad trace is refused before the engine is even asked
    with http_client.new_client(spec.auth_headers()) as client:
        check_server(spec, client)
        # Without a warm-up the window opens with the first request, which may reach the engine before the
        # runner sees Locust start: its counters are read before any request is sent.
        opening = None if spec.warmup_s else _scrape(spec, client)
    work = Path(tempfile.mkdtemp(prefix="kvtune-load-", dir=log_dir))
    samples = work / "samples.jsonl"
    processes = _start_locust(spec, samples, work)
    try:
        started = _wait_started(samples, processes, timeout=300.0)
        window_start = started + spec.warmup_s
        window_end = math.inf if spec.duration_s is None else window_start + spec.duration_s
        deadline = window_start + (spec.longest_window_s or math.inf)

        def progress() -> None:
            if on_progress:
                on_progress(_progress(spec, work, started, arrivals))

        def window_open() -> bool:
            now = time.time()
            if now < window_end:
                return True
            return now < deadline and _answered_since(work, window_start) < (spec.measured_requests or 0)

        with http_client.new_client(spec.auth_headers()) as client:
            _sleep_until(window_start, processes, work, progress)
            before = opening or _scrape(spec, client)
            peaks = metrics_window.Peaks()
            while window_open() and not _all_stopped(work):
                peaks.update(_scrape(spec, client))
                _check_alive(processes)
                progress()
                _sleep_while_running(_next_look(window_end, scrape_interval), work)
            ended = _all_stopped(work)  # every user stopped: the workload's end came first
            if not ended and spec.measured_requests is not None:
                # The count is in: the window closes now, and the users stop sending.
                window_end = min(deadline, time.time())
                write_atomic(work / STOP_FILE, repr(window_end))
            # The window's last requests finish after it ends; the engine records their queue and prefill
            # times (and any preemption) only then, so its counters are read once they have drained.
            _wait_drained(work, processes, timeout=_stop_timeout(spec) + _DRAIN_MARGIN_S)
            after = _scrape(spec, client)
            peaks.update(after)
        _finish(processes, stop_timeout=_stop_timeout(spec))
        records = _read_samples(work)
    finally:
        _stop(processes)
        if log_dir is None:  # nobody asked to keep the raw samples and Locust logs
            shutil.rmtree(work, ignore_errors=True)
    if ended:  # the window closes with the last answer, so rates are not diluted by the time after it
        window_end = min(window_end, _last_answer(records, default=time.time()))
    return summarize(spec, records, window_start, window_end, engine_deltas(before, after, peaks), arrivals)


def _trace_arrivals(spec: LoadSpec) -> list[float] | None:
    """A trace's arrival offsets (read and checked now); None for a workload without an end."""
    if spec.workload != "trace":
        return None
    try:
        return trace_arrivals(TraceArgs.of(spec.workload_args, spec.seed), spec.arrival, spec.max_tokens)
    except WorkloadError as exc:
        raise LoadTestError(f"workload_args: {exc}") from None


def _next_look(window_end: float, scrape_interval: float) -> float:
    """Seconds until the loop looks again: a scrape interval, shortened to end on the window's end."""
    left = window_end - time.time()
    return min(scrape_interval, left) if left > 0 else scrape_interval


def _answered_since(work: Path, start: float) -> int:
    """Requests intended at or after START that were answered without error, from the samples so far."""
    answered = 0
    for path in work.glob("samples.*.jsonl"):
        for record in read_samples(path, while_written=True):  # a line being written: next look
            answered += record.get("error") is None and record.get("intended", 0.0) >= start
    return answered


def _progress(spec: LoadSpec, work: Path, started: float, arrivals: list[float] | None) -> float:
    """Share of the run done: of its seconds, or (a trace run to its end) of its requests answered."""
    if spec.run_seconds is not None or not arrivals:
        return (time.time() - started) / (spec.run_seconds or 1.0)
    answered = sum(count_lines(path) for path in work.glob("samples.*.jsonl"))
    return answered / len(arrivals)


def _last_answer(records: list[dict[str, Any]], default: float) -> float:
    """Just after the last answer ended (e2e runs from the intended time)."""
    return max((r["intended"] + r["e2e"] for r in records), default=default - 0.001) + 0.001


def check_server(spec: LoadSpec, client: httpx.Client) -> None:
    """The URL answers as a vLLM server: an OpenAI model list (with the spec's model) and vLLM's metrics,
    read within a deadline and a size cap, parsed strictly (a page that merely mentions "vllm:" is not)."""
    url = spec.url.rstrip("/")
    shown = shown_url(url)
    served = _served_models(_get(client, f"{url}/v1/models", spec), shown)
    if not served:
        raise ServerError(f"{shown} serves no model; start the engine with a model")
    if spec.model and spec.model not in served:
        listed = shown_text(", ".join(served), 200)
        raise ServerError(f"model {spec.model!r} is not served by {shown}; it serves: {listed}")
    exposition = _parse_metrics(_get(client, f"{url}/metrics", spec, max_bytes=METRICS_MAX_BYTES), shown)
    if not any(sample.name.startswith("vllm:") for sample in exposition.samples):
        raise ServerError(f"{shown}/metrics has no vllm: metric: {shown} is not a vLLM engine")
    # A metric a result is computed from that the parser had to leave out (+Inf, NaN, a negative counter).
    broken = sorted(name for name in exposition.skipped if name in READ_METRICS)
    if broken:
        why = shown_text(f"{broken[0]} {exposition.skipped[broken[0]]}", 120)
        raise ServerError(f"{shown}/metrics gives {why}: not a working vLLM engine")


def _get(
    client: httpx.Client, url: str, spec: LoadSpec, *, max_bytes: int = http_client.MAX_RESPONSE_BYTES
) -> httpx.Response:
    shown = shown_url(url)
    try:
        response = http_client.get(client, url, deadline_s=CHECK_DEADLINE_S, max_bytes=max_bytes)
    except http_client.LimitExceeded as exc:  # says what was exceeded, with the URL shown safely
        raise ServerError(str(exc)) from None
    except httpx.TimeoutException as exc:
        raise ServerError(
            f"{shown} went quiet for more than {http_client.READ_TIMEOUT_S:g} s ({exc.__class__.__name__}); "
            "is the engine overloaded or stuck?"
        ) from None
    except httpx.HTTPError as exc:
        reason = shown_text(f"{exc.__class__.__name__}: {exc}", 200)
        raise ServerError(f"cannot reach {shown} ({reason}); start the engine") from None
    if response.status_code in (401, 403):
        given = "refused the API key given" if spec.api_key else f"needs an API key (set {API_KEY_ENV})"
        raise ServerError(f"{shown} answered HTTP {response.status_code}: the server {given}")
    if response.is_redirect:
        target = shown_text(shown_url(response.headers.get("location", "")), 200)
        raise ServerError(
            f"{shown} answered HTTP {response.status_code}, a redirect to {target!r}: kvtune does not follow "
            "redirects (they would carry the API key elsewhere); give the URL of the engine itself"
        )
    if response.status_code != 200:
        kind = shown_text(response.headers.get("content-type", "no content type"), 60)
        raise ServerError(f"{shown} answered HTTP {response.status_code} ({kind}): not a vLLM engine's API")
    return response


def _served_models(response: httpx.Response, shown: str) -> list[str]:
    """The ids of an OpenAI model list, {"data": [{"id": "..."}, ...]}; ServerError for anything else."""
    not_a_list = f"{shown}/v1/models is not an OpenAI model list"
    try:
        listed = http_client.strict_json(response)
    except http_client.NotJson as exc:
        raise ServerError(f"{not_a_list} (not JSON: {shown_text(str(exc), 80)}): not a vLLM server") from None
    entries = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(entries, list):
        raise ServerError(f"{not_a_list} (no `data` array): not a vLLM server")
    served = []
    for entry in entries:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            raise ServerError(f"{not_a_list} (an entry without a string `id`): not a vLLM server")
        served.append(model_id)
    return served


def _parse_metrics(response: httpx.Response, shown: str) -> metrics.Exposition:
    """Prometheus text exposition, strictly: ServerError for a body that is not (HTML, JSON, binary)."""
    try:
        return metrics.read_exposition(response.content.decode("utf-8"))
    except UnicodeDecodeError:
        raise ServerError(f"{shown}/metrics is not UTF-8 text: not Prometheus metrics") from None
    except metrics.ImpossibleMetrics as exc:  # Prometheus text, but numbers no one engine exports together
        raise ServerError(f"{shown}/metrics: {shown_text(str(exc), 400)}") from None
    except metrics.ExpositionError as exc:
        reason = shown_text(str(exc), 120)
        raise ServerError(f"{shown}/metrics is not Prometheus text ({reason}): not a vLLM engine") from None


def _scrape(spec: LoadSpec, client: httpx.Client) -> list[metrics.Sample]:
    """The engine's metrics now; samples no engine would export (+Inf, NaN) are left out by the parser."""
    url = spec.url.rstrip("/")
    try:
        response = http_client.get(
            client, f"{url}/metrics", deadline_s=CHECK_DEADLINE_S, max_bytes=METRICS_MAX_BYTES
        )
        if response.status_code != 200:  # not raise_for_status: its message holds the URL, password and all
            raise LoadTestError(
                f"lost the engine's metrics mid-run: {shown_url(url)}/metrics answered HTTP "
                f"{response.status_code}"
            )
        exposition = _parse_metrics(response, shown_url(url))
    except httpx.HTTPError as exc:
        reason = shown_text(f"{exc.__class__.__name__}: {exc}", 200)
        raise LoadTestError(f"lost the engine's metrics mid-run ({reason})") from None
    except ServerError as exc:
        raise LoadTestError(f"lost the engine's metrics mid-run: {exc}") from None
    return exposition.samples


def summarize(
    spec: LoadSpec,
    records: list[dict[str, Any]],
    start: float,
    end: float,
    engine: Any,
    arrivals: list[float] | None = None,
) -> LoadResult:
    """Client statistics over requests intended inside [start, end); ARRIVALS: a trace's offsets."""
    window = [r for r in records if start <= r["intended"] < end]
    ok = [r for r in window if r["error"] is None]
    duration = end - start
    paced = spec.arrival != "closed"
    lateness = [r["sent"] - r["intended"] for r in window] if paced else []
    designed = sum(r["designed_prompt_tokens"] for r in ok)
    # Throughput counts what completed inside the window (completion = intended + e2e, as e2e is
    # measured from the intended send time).
    completed = [r for r in records if r["error"] is None and start <= r["intended"] + r["e2e"] < end]
    return LoadResult(
        workload=spec.workload,
        arrival=spec.arrival,
        users=spec.users,
        window_s=duration,
        requests=len(ok),
        errors=len(window) - len(ok),
        # A window without a single request says nothing of its own: the errors before it say why.
        error_examples=sorted({r["error"] for r in (window or records) if r["error"]})[:5],
        ttft=Percentiles.of([r["ttft"] for r in ok]),
        ttft_p99_over_time=[
            Percentiles.of([r["ttft"] for r in ok if lo <= r["intended"] < lo + duration / 4]).p99
            for lo in (start + k * duration / 4 for k in range(4))
        ],
        ttft_trend=trend([r["intended"] - start for r in ok], [r["ttft"] for r in ok]),
        itl=Percentiles.of([gap for r in ok for gap in r["itl"]]),
        e2e=Percentiles.of([r["e2e"] for r in ok]),
        request_rate=len(completed) / duration,
        output_token_rate=sum(r["completion_tokens"] or 0 for r in completed) / duration,
        intended_rate=spec.rate if spec.arrival in ("constant", "poisson") else None,
        achieved_rate=sum(1 for r in records if start <= r["sent"] < end) / duration,
        unsent=_unsent(spec, records, start, end, arrivals),
        lateness=Lateness.of(lateness) if paced else None,
        trace_cuts=_trace_cuts(window) if spec.workload == "trace" else None,
        target_reuse=sum(r["designed_shared_tokens"] for r in ok) / designed if designed else None,
        engine=engine,
        samples=LatencySamples.of(
            [r["ttft"] for r in ok], [gap for r in ok for gap in r["itl"]], [r["e2e"] for r in ok], lateness
        ),
    )


def _trace_cuts(window: list[dict[str, Any]]) -> TraceCuts:
    prompt = [r.get("cut_prompt_tokens") or 0 for r in window]
    output = [r.get("cut_output_tokens") or 0 for r in window]
    return TraceCuts(
        requests=sum(1 for p, o in zip(prompt, output, strict=True) if p or o),
        prompt_tokens=sum(prompt),
        output_tokens=sum(output),
    )


def _unsent(
    spec: LoadSpec,
    records: list[dict[str, Any]],
    start: float,
    end: float,
    arrivals: list[float] | None = None,
) -> int:
    """Open loop: request slots due inside the window that no free client slot sent before the run ended.

    Each Locust process replays the same seeded schedule (pacing.schedule_for: a rate, or a trace's own
    ARRIVALS) from its first request, so the slots it owed the window are recomputed exactly; Poisson counts
    vary, a fixed rate x time would not, and a trace's schedule ends with the trace.
    """
    if spec.arrival == "closed" or (spec.arrival != "trace" and spec.rate is None):
        return 0
    rate = spec.rate / max(spec.workers, 1) if spec.rate else None
    missing = 0
    for source in {r["_source"] for r in records}:
        own = [r for r in records if r["_source"] == source]
        schedule = schedule_for(spec.arrival, rate, spec.seed, arrivals)
        if schedule is None:
            continue
        schedule.start = min(r["intended"] for r in own)
        due = sum(1 for moment in schedule.times_before(end) if moment >= start)
        missing += max(0, due - sum(1 for r in own if start <= r["intended"] < end))
    return missing


def _locust_argv(spec: LoadSpec) -> list[str]:
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(locustfile(spec.workload)),
        "--loglevel",
        "WARNING",
        # Failed requests are counted from the samples; Locust's exit code then says only whether it broke.
        "--exit-code-on-error",
        "0",
    ]


def _start_locust(spec: LoadSpec, samples: Path, work: Path) -> list[subprocess.Popen[bytes]]:
    common = _locust_argv(spec) + spec.locust_args(samples)
    # No --run-time: Locust's clock starts before its users do (tokenizer loading). Users stop by
    # themselves --run-for seconds after the test starts and finish what is in flight.
    headless = ["--headless", "-u", str(spec.users), "-r", str(_spawn_rate(spec)), "--only-summary",
                "--stop-timeout", f"{_stop_timeout(spec):.0f}"]  # fmt: skip
    env = spec.locust_env()

    def launch(argv: list[str], name: str) -> subprocess.Popen[bytes]:
        log_path = work / f"{name}.log"
        with log_path.open("wb") as out:
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        _LOGS[proc.pid] = log_path
        return proc

    if spec.workers == 0:
        return [launch(common + headless, "locust")]
    port = free_port()
    master = launch(
        common
        + headless
        + [
            "--master",
            "--master-bind-host",
            "127.0.0.1",
            "--master-bind-port",
            str(port),
            "--expect-workers",
            str(spec.workers),
        ],
        "master",
    )
    workers = [
        launch([*common, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)], f"worker{i}")
        for i in range(spec.workers)
    ]
    return [master, *workers]


def _spawn_rate(spec: LoadSpec) -> int:
    """Users started per second: a closed loop's within a second; an open loop's at once (up to Locust's
    advice of 100 a second), so every user is there when the first requests are due."""
    return spec.users if spec.arrival == "closed" else max(spec.users, 100)


def _stop_timeout(spec: LoadSpec) -> float:
    """How long requests may run after the last one was due; the Locust users fail those still running."""
    return min(spec.request_timeout_s, 60.0)


def _all_stopped(work: Path) -> bool:
    """Every Locust process that started sending has its users stopped, their requests answered."""
    expected = len(list(work.glob(f"*{STARTED_SUFFIX}")))
    return expected > 0 and len(list(work.glob("*.done"))) >= expected


def _wait_drained(work: Path, processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every Locust process's users stopped sending and finished their requests in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not _all_stopped(work):
        _check_alive(processes)
        time.sleep(0.2)


def _sleep_while_running(seconds: float, work: Path) -> None:
    """Sleep up to SECONDS, waking early once every user stopped (the end of a trace is noticed at once)."""
    deadline = time.monotonic() + seconds
    while not _all_stopped(work) and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.1, left))


def _finish(processes: list[subprocess.Popen[bytes]], stop_timeout: float) -> None:
    """Ask Locust (the master, if distributed) to stop gracefully and wait for every process. A Locust that
    quit by itself (headless, at a trace's end) is not signalled: its pid may be another process's now."""
    if processes[0].poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[0].pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout + 30
    for proc in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))


def _wait_started(samples: Path, processes: list[subprocess.Popen[bytes]], timeout: float) -> float:
    """Wall time at which the first Locust process began sending (its users write a marker)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        markers = sorted(samples.parent.glob(f"*{STARTED_SUFFIX}"))
        if markers:
            return min(float(m.read_text()) for m in markers)
        _check_alive(processes)
        time.sleep(0.2)
    raise LoadTestError(f"Locust did not start sending within {timeout:.0f} s (logs in {samples.parent})")


def _check_alive(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        code = proc.poll()
        if code is not None and code != 0:
            raise LoadTestError(_failure_message(proc, code))


def _failure_message(proc: subprocess.Popen[bytes], code: int) -> str:
    log_file = _LOGS.get(proc.pid, Path())
    text = _tail(log_file, _LOG_TAIL_BYTES) if log_file.is_file() else ""
    reasons = [line.removeprefix("kvtune: ") for line in text.splitlines() if line.startswith("kvtune: ")]
    reason = reasons[-1] if reasons else (text.strip().splitlines() or ["no output"])[-1]
    return f"load test failed (locust exit {code}): {shown_text(reason)}"


def _tail(path: Path, size: int) -> str:
    with path.open("rb") as log_file:
        log_file.seek(max(0, path.stat().st_size - size))
        return log_file.read().decode(errors="replace")


def _sleep_until(
    moment: float, processes: list[subprocess.Popen[bytes]], work: Path, progress: Callable[[], None]
) -> None:
    while time.time() < moment and not _all_stopped(work):
        _check_alive(processes)
        progress()
        time.sleep(min(0.5, max(0.0, moment - time.time())))


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    stop_groups(processes, grace_s=15.0)
    for proc in processes:
        _LOGS.pop(proc.pid, None)


def _read_samples(work: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in sorted(work.glob("samples.*.jsonl")):
        records.extend(record | {"_source": path.name} for record in read_samples(path))
    return records


__all__ = [
    "LoadResult",
    "LoadSpec",
    "LoadTestError",
    "ServerError",
    "WorkloadError",
    "WorkloadName",
    "run_load",
    "summarize",
]
