"""Run a workload against an engine with Locust, headless, and return a typed result.

Locust runs in its own processes (one, or a master and workers on loopback): importing it patches a process
for gevent, and the caller (the sweep) also runs engines and threads. The Locust users write one JSON line per
request; this module reads them, keeps the measured window (warm-up excluded) and adds the engine's own
metric deltas over that window.

The Locust files ship inside the package (kvtune.loadgen.locustfiles), so a wheel install runs them. An
engine's API key reaches the Locust processes only through their environment (KVTUNE_API_KEY), never
their command line. Before any Locust process starts, the URL must answer as a vLLM server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Self

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from kvtune import metrics
from kvtune.engine import free_port
from kvtune.loadgen.locustfiles import locustfile
from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.loadgen.results import (
    GaugePeaks,
    LatencySamples,
    LoadResult,
    Percentiles,
    engine_deltas,
    trend,
)
from kvtune.loadgen.workload_args import (
    API_KEY_ENV,
    DEFAULT_MAX_TOKENS,
    WorkloadError,
    WorkloadName,
    validate_workload_args,
)
from kvtune.processes import stop_groups

log = logging.getLogger(__name__)

STARTED_SUFFIX = ".started"
# Each Locust process's output file, by pid, to quote its error when it exits early.
_LOGS: dict[int, Path] = {}


class LoadTestError(RuntimeError):
    """The load test could not run (bad input, unreachable host); str() says why and how to fix it."""


class ServerError(LoadTestError):
    """The URL does not answer as a vLLM server (unreachable, needs a key, not OpenAI, no metrics)."""


class LoadSpec(BaseModel):
    """What to run: workload W at load L for T seconds against URL."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="engine base URL, e.g. http://127.0.0.1:8000")
    workload: WorkloadName = "shared_prefix"
    workload_args: dict[str, str | int | float] = Field(
        default_factory=dict, description="the workload's own flags, e.g. {'prefix-reuse': 0.5}"
    )
    model: str = Field("", description="served model name; default: the first the server lists")
    users: int = Field(
        4, ge=1, description="closed loop: concurrent users; open loop: most requests in flight"
    )
    arrival: Literal["closed", "constant", "poisson"] = "closed"
    rate: float | None = Field(None, gt=0, description="open-loop arrival rate, requests per second")
    duration_s: float = Field(30.0, gt=0, description="measured window")
    warmup_s: float = Field(5.0, ge=0, description="load before the window, excluded from results")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="output tokens per request")
    ignore_eos: bool = Field(False, description="always generate max_tokens (fixed output length)")
    workers: int = Field(0, ge=0, description="0: one Locust process; N: a master and N workers on loopback")
    seed: int = 0
    request_timeout_s: float = Field(600.0, gt=0)
    api_key: SecretStr | None = Field(
        None,
        exclude=True,
        description=f"the engine's API key; Locust gets it in {API_KEY_ENV} only, never on its command line",
    )

    @model_validator(mode="after")
    def _workload_args_are_the_workloads(self) -> Self:
        try:
            self.workload_args = validate_workload_args(self.workload, self.workload_args)
        except WorkloadError as exc:
            raise ValueError(f"workload_args: {exc}") from None
        return self

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key.get_secret_value()}"} if self.api_key else {}

    def locust_env(self) -> dict[str, str]:
        """The Locust processes' environment: the caller's, with the API key set (or removed) by this spec."""
        env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
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
            str(self.warmup_s + self.duration_s),
        ]
        if self.model:
            args += ["--model", self.model]
        if self.ignore_eos:
            args.append("--ignore-eos")
        if self.arrival != "closed":
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
    with httpx.Client(headers=spec.auth_headers(), timeout=10.0) as client:
        check_server(spec, client)
    work = Path(tempfile.mkdtemp(prefix="kvtune-load-", dir=log_dir))
    samples = work / "samples.jsonl"
    processes = _start_locust(spec, samples, work)
    try:
        started = _wait_started(samples, processes, timeout=300.0)
        window_start = started + spec.warmup_s
        window_end = window_start + spec.duration_s
        with httpx.Client(headers=spec.auth_headers(), timeout=10.0) as client:
            _sleep_until(window_start, processes, on_progress, started, spec)
            before = _scrape(spec, client)
            peaks = GaugePeaks()
            while time.time() < window_end:
                peaks.update(_scrape(spec, client))
                _check_alive(processes)
                if on_progress:
                    on_progress((time.time() - started) / (spec.warmup_s + spec.duration_s))
                time.sleep(min(scrape_interval, max(0.0, window_end - time.time())))
            # The window's last requests finish after it ends; the engine records their queue and prefill
            # times (and any preemption) only then, so its counters are read once they have drained.
            _wait_drained(work, processes, timeout=_stop_timeout(spec))
            after = _scrape(spec, client)
            peaks.update(after)
        _finish(processes, stop_timeout=_stop_timeout(spec))
        records = _read_samples(work)
    finally:
        _stop(processes)
        if log_dir is None:  # nobody asked to keep the raw samples and Locust logs
            shutil.rmtree(work, ignore_errors=True)
    return summarize(spec, records, window_start, window_end, engine_deltas(before, after, peaks))


def check_server(spec: LoadSpec, client: httpx.Client) -> None:
    """The URL answers as a vLLM server: an OpenAI model list (with the spec's model) and vLLM's metrics."""
    url = spec.url.rstrip("/")
    listed = _json_or_none(_get(client, f"{url}/v1/models", spec))
    models = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(models, list):
        raise ServerError(f"{url}/v1/models is not an OpenAI model list: {url} is not a vLLM server")
    served = [str(entry.get("id")) for entry in models if isinstance(entry, dict)]
    if not served:
        raise ServerError(f"{url} serves no model; start the engine with a model")
    if spec.model and spec.model not in served:
        raise ServerError(f"model {spec.model!r} is not served by {url}; it serves: {', '.join(served)}")
    text = _get(client, f"{url}/metrics", spec).text
    if "vllm:" not in text:
        raise ServerError(f"{url}/metrics has no vllm: metrics: {url} is not a vLLM engine")


def _get(client: httpx.Client, url: str, spec: LoadSpec) -> httpx.Response:
    try:
        response = client.get(url)
    except httpx.HTTPError as exc:
        raise ServerError(f"cannot reach {url} ({exc.__class__.__name__}: {exc}); start the engine") from None
    if response.status_code in (401, 403):
        given = "refused the API key given" if spec.api_key else f"needs an API key (set {API_KEY_ENV})"
        raise ServerError(f"{url} answered HTTP {response.status_code}: the server {given}")
    if response.status_code != 200:
        kind = response.headers.get("content-type", "no content type")
        raise ServerError(f"{url} answered HTTP {response.status_code} ({kind}): not a vLLM engine's API")
    return response


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _scrape(spec: LoadSpec, client: httpx.Client) -> list[metrics.Sample]:
    try:
        return metrics.scrape(spec.url, client)
    except httpx.HTTPError as exc:
        raise LoadTestError(f"lost the engine's metrics mid-run ({exc.__class__.__name__}: {exc})") from None


def summarize(
    spec: LoadSpec, records: list[dict[str, Any]], start: float, end: float, engine: Any
) -> LoadResult:
    """Client statistics over requests intended inside [start, end)."""
    window = [r for r in records if start <= r["intended"] < end]
    ok = [r for r in window if r["error"] is None]
    duration = end - start
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
        error_examples=sorted({r["error"] for r in window if r["error"]})[:5],
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
        intended_rate=spec.rate if spec.arrival != "closed" else None,
        achieved_rate=sum(1 for r in records if start <= r["sent"] < end) / duration,
        unsent=_unsent(spec, records, start, end),
        target_reuse=sum(r["designed_shared_tokens"] for r in ok) / designed if designed else None,
        engine=engine,
        samples=LatencySamples.of(
            [r["ttft"] for r in ok], [gap for r in ok for gap in r["itl"]], [r["e2e"] for r in ok]
        ),
    )


def _unsent(spec: LoadSpec, records: list[dict[str, Any]], start: float, end: float) -> int:
    """Open loop: request slots due inside the window that no free client slot sent before the run ended.

    Each Locust process replays the same seeded schedule (pacing.ArrivalSchedule) from its first request,
    so the slots it owed the window are recomputed exactly; Poisson counts vary, a fixed rate x time would
    not.
    """
    if spec.arrival == "closed" or spec.rate is None:
        return 0
    per_process = spec.rate / max(spec.workers, 1)
    missing = 0
    for source in {r["_source"] for r in records}:
        own = [r for r in records if r["_source"] == source]
        schedule = ArrivalSchedule(
            per_process, spec.arrival, start=min(r["intended"] for r in own), seed=spec.seed
        )
        due, index = 0, 0
        while (moment := schedule.time_of(index)) < end:
            due += start <= moment
            index += 1
        missing += max(0, due - sum(1 for r in own if start <= r["intended"] < end))
    return missing


def _locust_argv(spec: LoadSpec) -> list[str]:
    return [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(locustfile(spec.workload)),
        "--host",
        spec.url,
        "--loglevel",
        "WARNING",
    ]


def _start_locust(spec: LoadSpec, samples: Path, work: Path) -> list[subprocess.Popen[bytes]]:
    common = _locust_argv(spec) + spec.locust_args(samples)
    # No --run-time: Locust's clock starts before its users do (tokenizer loading). Users stop by
    # themselves --run-for seconds after the test starts and finish what is in flight.
    headless = ["--headless", "-u", str(spec.users), "-r", str(spec.users), "--only-summary",
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


def _stop_timeout(spec: LoadSpec) -> float:
    return min(spec.request_timeout_s, 60.0)


def _wait_drained(work: Path, processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every Locust process's users stopped sending and finished their requests in flight."""
    expected = len(list(work.glob(f"*{STARTED_SUFFIX}")))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(work.glob("*.done"))) < expected:
        _check_alive(processes)
        time.sleep(0.2)


def _finish(processes: list[subprocess.Popen[bytes]], stop_timeout: float) -> None:
    """Ask Locust (the master, if distributed) to stop gracefully and wait for every process."""
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
    text = log_file.read_text(errors="replace") if log_file.is_file() else ""
    reasons = [line.removeprefix("kvtune: ") for line in text.splitlines() if line.startswith("kvtune: ")]
    reason = reasons[-1] if reasons else (text.strip().splitlines() or ["no output"])[-1]
    return f"load test failed (locust exit {code}): {reason}"


def _sleep_until(
    moment: float,
    processes: list[subprocess.Popen[bytes]],
    on_progress: Callable[[float], None] | None,
    started: float,
    spec: LoadSpec,
) -> None:
    while time.time() < moment:
        _check_alive(processes)
        if on_progress:
            on_progress((time.time() - started) / (spec.warmup_s + spec.duration_s))
        time.sleep(min(0.5, max(0.0, moment - time.time())))


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    stop_groups(processes, grace_s=15.0)
    for proc in processes:
        _LOGS.pop(proc.pid, None)


def _read_samples(work: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(work.glob("samples.*.jsonl")):
        records += [
            json.loads(line) | {"_source": path.name}
            for line in path.read_text().splitlines()
            if line.strip()
        ]
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
