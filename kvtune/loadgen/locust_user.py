"""Locust users that stream from vLLM's OpenAI API and report TTFT and ITL as rows of their own.

Import this only in a Locust process: importing locust patches the whole process for gevent.
Each locustfile in `loadtests/` subclasses `LLMUser` with one workload.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, NoReturn

import gevent
import httpx
from locust import User, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import MasterRunner, WorkerRunner

from kvtune import metrics, openai_client
from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.loadgen.text import TextMaker, load_tokenizer
from kvtune.loadgen.workloads import Conversation, LLMRequest, MultiTurn, Workload, WorkloadError

log = logging.getLogger(__name__)

TTFT = "TTFT"
ITL = "ITL"


@events.init_command_line_parser.add_listener
def _common_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("kvtune")
    group.add_argument(
        "--model",
        env_var="KVTUNE_MODEL",
        default="",
        help="served model name (default: the first the server lists)",
    )
    group.add_argument(
        "--tokenizer",
        env_var="KVTUNE_TOKENIZER",
        default="",
        help="tokenizer folder or hub id (default: the server's model)",
    )
    group.add_argument(
        "--max-tokens", env_var="KVTUNE_MAX_TOKENS", type=int, default=64, help="output tokens per request"
    )
    group.add_argument(
        "--ignore-eos",
        env_var="KVTUNE_IGNORE_EOS",
        action="store_true",
        help="always generate --max-tokens tokens",
    )
    group.add_argument(
        "--arrival",
        env_var="KVTUNE_ARRIVAL",
        choices=("closed", "constant", "poisson"),
        default="closed",
        help="closed: each user waits for its answer; constant/poisson: open loop at --arrival-rate",
    )
    group.add_argument(
        "--arrival-rate",
        env_var="KVTUNE_ARRIVAL_RATE",
        type=float,
        default=1.0,
        help="open-loop requests per second",
    )
    group.add_argument(
        "--samples-file",
        env_var="KVTUNE_SAMPLES_FILE",
        default="",
        help="write one JSON line per request here",
    )
    group.add_argument(
        "--seed", env_var="KVTUNE_SEED", type=int, default=0, help="seed of generated prompts and arrivals"
    )
    group.add_argument(
        "--request-timeout",
        env_var="KVTUNE_REQUEST_TIMEOUT",
        type=float,
        default=600.0,
        help="seconds before a request fails",
    )
    group.add_argument(
        "--run-for",
        env_var="KVTUNE_RUN_FOR",
        type=float,
        default=0.0,
        help="seconds after the test starts when users stop sending and finish what is in flight",
    )


@dataclass
class ServedModel:
    name: str
    root: str


def discover_model(host: str, wanted: str) -> ServedModel:
    """The model the server serves (the one named, or its first); exits with a clear message if not."""
    try:
        listed = httpx.get(f"{host.rstrip('/')}/v1/models", timeout=10.0).json().get("data", [])
    except httpx.HTTPError as exc:
        fail(f"cannot reach {host} ({exc.__class__.__name__}: {exc}); start the engine or fix --host")
    models = {entry["id"]: entry.get("root") or entry["id"] for entry in listed}
    if not models:
        fail(f"{host} serves no model")
    name = wanted or next(iter(models))
    if name not in models:
        fail(f"model {name!r} is not served by {host}; it serves: {', '.join(models)}. Fix --model")
    return ServedModel(name, models[name])


def fail(message: str) -> NoReturn:
    """Bad input: say why on stderr and leave with exit code 2, without a traceback."""
    sys.stderr.write(f"kvtune: {message}\n")
    sys.stderr.flush()
    os._exit(2)


class LLMUser(User):
    """A user streaming requests of one workload. Subclasses implement `build_workload`."""

    abstract = True
    _workload: ClassVar[Workload | None] = None
    _model: ClassVar[ServedModel | None] = None
    _schedule: ClassVar[ArrivalSchedule | None] = None
    _counter: ClassVar[itertools.count[int]]
    _samples: ClassVar[IO[str] | None] = None
    _active: ClassVar[int] = 0

    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        raise NotImplementedError

    @classmethod
    def prepare(cls, environment: Environment) -> None:
        """Once per process: find the model, load its tokenizer, build the workload and pacing."""
        if cls._workload is not None:
            return
        options = environment.parsed_options
        if options is None:
            fail("kvtune load tests run under the locust command (no parsed options)")
        model = discover_model(environment.host or options.host, options.model)
        # Loading a tokenizer and building prompts takes seconds of CPU: do it on a native thread so
        # this process's event loop keeps answering (a worker's heartbeats to its master).
        hub = gevent.get_hub()
        maker = TextMaker(hub.threadpool.apply(load_tokenizer, (options.tokenizer or model.root,)))
        # Bad input comes back as a value: an exception raised in gevent's pool prints a traceback.
        workload = hub.threadpool.apply(_build_or_error, (cls, options, maker))
        if isinstance(workload, WorkloadError):
            fail(str(workload))
        cls._model, cls._workload, cls._counter = model, workload, itertools.count()
        if options.arrival != "closed":
            cls._schedule = ArrivalSchedule(options.arrival_rate, options.arrival, seed=options.seed)
        if options.samples_file:
            path = Path(options.samples_file)
            cls._samples = _marker(options.samples_file, path.suffix).open("a", buffering=1)
        log.info("workload %s against %s: %s", workload.name, model.name, json.dumps(workload.describe()))

    def on_start(self) -> None:
        type(self).prepare(self.environment)
        if not _TEST_START[0]:
            _mark_started(self.environment)
        LLMUser._active += 1
        options = self.environment.parsed_options
        self.options = options
        self.conversation = Conversation()
        self.http = httpx.Client(
            base_url=self.host or "", timeout=options.request_timeout if options else 600.0
        )

    def on_stop(self) -> None:
        self.http.close()
        LLMUser._active -= 1
        if LLMUser._active == 0 and self.options.run_for and self.options.samples_file:
            _marker(self.options.samples_file, ".done").write_text(repr(time.time()))

    @task
    def one_request(self) -> None:
        cls = type(self)
        if cls._workload is None:
            type(self).prepare(self.environment)
        assert cls._workload is not None  # noqa: S101 - prepare() sets it or exits
        index = cls._schedule.next_index() if cls._schedule else next(cls._counter)
        due = cls._schedule.time_of(index) if cls._schedule else time.time()
        # Past the end of the run nothing is sent; open loop counts the slots it could not send as unsent.
        if self.options.run_for and max(due, time.time()) >= _TEST_START[0] + self.options.run_for:
            raise StopUser
        # Build (and tokenize) the prompt before the clock starts: it is the client's time, not the server's.
        request = cls._workload.next_request(index, self.conversation)
        if cls._schedule is not None:
            intended = due
            time.sleep(max(0.0, intended - time.time()))
        else:
            intended = time.time()
        self._send(request, intended)

    def _send(self, request: LLMRequest, intended: float) -> None:
        cls = type(self)
        assert cls._model is not None and cls._workload is not None  # noqa: S101 - set by prepare()
        name = cls._workload.name
        options = self.options
        body = openai_client.stream_body(cls._model.name, request.max_tokens)
        if options.ignore_eos:
            body["ignore_eos"] = True
        path = "/v1/chat/completions"
        if request.messages is not None:
            body["messages"] = request.messages
        else:
            path, body["prompt"] = "/v1/completions", request.prompt
        # Measure from the intended send time: perf_counter's origin shifted back by any lateness.
        sent = time.time()
        origin = time.perf_counter() - (sent - intended)
        error: Exception | None = None
        result = openai_client.StreamResult()
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
                result = openai_client.time_stream(
                    openai_client.sse_events(response.iter_lines()), origin, time.perf_counter
                )
            if result.ttft is None:
                raise RuntimeError("stream ended without content")
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            error = exc
            result.e2e = time.perf_counter() - origin
        fire = self.environment.events.request.fire
        fire(
            request_type="POST",
            name=name,
            response_time=result.e2e * 1000,
            response_length=result.completion_tokens or 0,
            exception=error,
            context={},
        )
        if error is None and result.ttft is not None:
            fire(
                request_type=TTFT,
                name=name,
                response_time=result.ttft * 1000,
                response_length=0,
                exception=None,
                context={},
            )
            for gap in itl_gaps(result.token_times):
                fire(
                    request_type=ITL,
                    name=name,
                    response_time=gap * 1000,
                    response_length=0,
                    exception=None,
                    context={},
                )
            if isinstance(cls._workload, MultiTurn):
                cls._workload.record_answer(self.conversation, result.text, result.completion_tokens or 0)
        if cls._samples is not None:
            record = sample_record(request, result, intended, error) | {"sent": sent}
            cls._samples.write(json.dumps(record) + "\n")


def _build_or_error(
    user_class: type[LLMUser], options: argparse.Namespace, maker: TextMaker
) -> Workload | WorkloadError:
    try:
        return user_class.build_workload(options, maker)
    except WorkloadError as exc:
        return exc


def itl_gaps(token_times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(token_times)]


def sample_record(
    request: LLMRequest, result: openai_client.StreamResult, intended: float, error: Exception | None
) -> dict[str, Any]:
    return {
        "intended": intended,
        "ttft": result.ttft,
        "e2e": result.e2e,
        "itl": itl_gaps(result.token_times),
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "designed_prompt_tokens": request.prompt_tokens,
        "designed_shared_tokens": request.shared_tokens,
        "error": None if error is None else f"{error.__class__.__name__}: {error}",
    }


# Wall time this process sent its first request: the origin of --run-for and of the runner's window.
_TEST_START = [0.0]


def _marker(samples_file: str, suffix: str) -> Path:
    path = Path(samples_file)
    return path.with_name(f"{path.stem}.{os.getpid()}{suffix}")


def _mark_started(environment: Environment) -> None:
    # The runner times its warm-up and measured window from this marker.
    _TEST_START[0] = time.time()
    options = environment.parsed_options
    if options is not None and options.samples_file:
        _marker(options.samples_file, ".started").write_text(repr(_TEST_START[0]))


_REUSE_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
_counters_at_start: dict[str, float] = {}


def _reuse_counters(host: str) -> dict[str, float]:
    try:
        samples = metrics.scrape(host.rstrip("/"))
    except httpx.HTTPError:
        return {}
    return {name: metrics.total(samples, name) for name in _REUSE_COUNTERS}


@events.test_start.add_listener
def _reuse_at_start(environment: Environment, **_kwargs: Any) -> None:
    if environment.host and not isinstance(environment.runner, WorkerRunner):
        _counters_at_start.update(_reuse_counters(environment.host))


@events.test_stop.add_listener
def _report_reuse(environment: Environment, **_kwargs: Any) -> None:
    """Say what share of prompt tokens the workload meant to be reusable, and what the engine reused."""
    if not environment.host or isinstance(environment.runner, WorkerRunner) or not _counters_at_start:
        return
    end = _reuse_counters(environment.host)
    hits, queries = (end.get(n, 0.0) - _counters_at_start.get(n, 0.0) for n in _REUSE_COUNTERS)
    targets = [
        user_class._workload.describe().get("target_reuse")
        for user_class in environment.user_classes
        if issubclass(user_class, LLMUser) and user_class._workload is not None
    ]
    target = f"{targets[0]:.1%}" if targets and targets[0] is not None else "not set by this workload"
    achieved = (
        f"{hits / queries:.1%} ({hits:.0f} of {queries:.0f} prompt tokens)" if queries else "no prompts"
    )
    log.info("prefix-cache reuse: target %s, engine hit rate %s", target, achieved)


@events.init.add_listener
def _prepare_workloads(environment: Environment, **_kwargs: Any) -> None:
    # Fail fast on a bad host, model or replay file before any user starts. Not on a master (it only
    # aggregates) nor a worker: a worker has told its master it is ready, and loading a tokenizer here
    # would block its event loop through the spawn message; its first user prepares instead.
    if isinstance(environment.runner, MasterRunner | WorkerRunner) or not environment.host:
        return
    for user_class in environment.user_classes:
        if issubclass(user_class, LLMUser):
            user_class.prepare(environment)
