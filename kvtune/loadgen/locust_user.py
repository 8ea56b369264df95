"""Locust users that stream from vLLM's OpenAI API: each request timed from its intended send, with its
TTFT and ITL (the gap between content chunks) kept apart from Locust's request statistics.

Import this only in a Locust process: importing locust patches the whole process for gevent.
Each Locust file in `kvtune.loadgen.locustfiles` subclasses `LLMUser` with one workload.
Importing this module also registers kvtune's Locust event listeners, which Locust needs before it
parses the command line and starts: the common flags (locust_flags.py), the TTFT / ITL statistics
(locust_token_stats.py), their web UI tab (locust_webui.py) and their end-of-run files (locust_outputs.py).
An API key, when the engine needs one, is read from the environment variable KVTUNE_API_KEY (never a
flag, so it is never on a command line or in the web UI) and sent on every request.
A workload with an end (a trace) stops its users when its last request is claimed, and the test once every
user has stopped: headless Locust then quits, its web UI shows the test stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import ssl
import time
from pathlib import Path
from typing import IO, Any, ClassVar

import certifi
import gevent
import httpx
from locust import User, events, task
from locust.env import Environment
from locust.exception import StopUser
from locust.runners import STATE_RUNNING, STATE_SPAWNING, MasterRunner, WorkerRunner

from kvtune import http_client, metrics, openai_client
from kvtune.files import write_atomic
from kvtune.loadgen import completions, locust_flags, locust_outputs, locust_webui
from kvtune.loadgen.completions import shown_text
from kvtune.loadgen.locust_discovery import (
    DISCOVERY_DEADLINE_S,
    ServedModel,
    auth_headers,
    discover_model,
    engine_block_size,
    fail,
)

# Where Locust files written before locust_flags.py import the flag helpers from.
from kvtune.loadgen.locust_flags import register_flags as register_flags
from kvtune.loadgen.locust_flags import register_workload_flags as register_workload_flags
from kvtune.loadgen.locust_token_stats import ITL, TOKEN_STATS, TTFT
from kvtune.loadgen.pacing import ArrivalSchedule, schedule_for
from kvtune.loadgen.results import counter_increase
from kvtune.loadgen.text import TextMaker, load_text_tokenizer
from kvtune.loadgen.trace_workload import TraceWorkload
from kvtune.loadgen.workload_args import STOP_FILE
from kvtune.loadgen.workloads import Conversation, LLMRequest, MultiTurn, Workload, WorkloadError

log = logging.getLogger(__name__)

# Their Locust event listeners are registered on import, which Locust needs before it parses the command
# line: every Locust file imports this module, so they come with it.
LISTENER_MODULES = (locust_flags, locust_outputs, locust_webui)

# An error answer's first bytes say what went wrong; the rest is not read.
_EXCERPT_BYTES = 300


class LLMUser(User):
    """A user streaming requests of one workload. Subclasses implement `build_workload`."""

    abstract = True
    # The workload is fitted to the engine's KV block size (a trace's blocks): read it from /metrics.
    reads_block_size: ClassVar[bool] = False
    _workload: ClassVar[Workload | None] = None
    _model: ClassVar[ServedModel | None] = None
    _schedule: ClassVar[ArrivalSchedule | None] = None
    _counter: ClassVar[itertools.count[int]]
    _limit: ClassVar[int | None] = None  # a workload with an end (a trace): its number of requests
    _ended: ClassVar[bool] = False  # every request of such a workload was claimed
    _samples: ClassVar[IO[str] | None] = None
    _active: ClassVar[int] = 0
    # One TLS context for every user: httpx builds one per client otherwise (~50 ms of CPU), and a user
    # starting while another's request is due would hold that request back.
    _tls: ClassVar[ssl.SSLContext | None] = None

    @classmethod
    def build_workload(cls, options: argparse.Namespace, maker: TextMaker) -> Workload:
        raise NotImplementedError

    @classmethod
    def prepare(cls, environment: Environment) -> None:
        """Once per process: find the model, load its tokenizer, build the workload and pacing.

        The served model (`cls._model`, with its max_model_len, and the engine's block size when the class
        `reads_block_size`) is known before `build_workload` runs: a trace is fitted to it."""
        if cls._workload is not None:
            return
        options = environment.parsed_options
        if options is None:
            fail("kvtune load tests run under the locust command (no parsed options)")
        host = environment.host or options.host
        model = discover_model(host, options.model)
        if cls.reads_block_size:
            model.block_size = engine_block_size(host)
        cls._model = model
        # Loading a tokenizer and building prompts takes seconds of CPU: do it on a native thread so
        # this process's event loop keeps answering (a worker's heartbeats to its master).
        hub = gevent.get_hub()
        maker = TextMaker(
            hub.threadpool.apply(
                load_text_tokenizer, (options.tokenizer or model.root, options.tokenizer_revision or None)
            )
        )
        # Bad input comes back as a value: an exception raised in gevent's pool prints a traceback.
        workload = hub.threadpool.apply(_build_or_error, (cls, options, maker))
        if isinstance(workload, WorkloadError):
            fail(str(workload))
        arrivals = workload.arrivals if isinstance(workload, TraceWorkload) else None
        if arrivals is not None and isinstance(environment.runner, WorkerRunner):
            fail("a trace is one sequence of requests: replay it in one Locust process, not --worker")
        try:
            cls._schedule = schedule_for(options.arrival, options.arrival_rate, options.seed, arrivals)
        except ValueError as exc:
            fail(f"--arrival {options.arrival}: {exc}; use loadtests/trace.py or another --arrival")
        cls._workload, cls._counter = workload, itertools.count()
        LLMUser._tls = LLMUser._tls or ssl.create_default_context(cafile=certifi.where())
        cls._limit = None if arrivals is None else len(arrivals)
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
            base_url=self.host or "",
            # Streams come uncompressed: no client can bound what one compressed read inflates to.
            headers=auth_headers() | {"Accept-Encoding": "identity"},
            timeout=options.request_timeout if options else 600.0,
            verify=LLMUser._tls or True,
            auth=http_client.OneCredential(),  # a --host user:password@ beside the key: refused, not Basic
        )

    def on_stop(self) -> None:
        self.http.close()
        LLMUser._active -= 1
        if LLMUser._active == 0:
            if self.options.samples_file:  # the runner reads the engine's counters once every user stopped
                _marker(self.options.samples_file, ".done").write_text(repr(time.time()))
            if type(self)._ended:
                gevent.spawn(_end_test, self.environment)

    @task
    def one_request(self) -> None:
        cls = type(self)
        if cls._workload is None:
            type(self).prepare(self.environment)
        assert cls._workload is not None  # noqa: S101 - prepare() sets it or exits
        index = cls._schedule.next_index() if cls._schedule else next(cls._counter)
        if cls._limit is not None and index >= cls._limit:
            cls._ended = True  # no cycling: a trace's second pass would reuse what its first one cached
            raise StopUser
        due = cls._schedule.time_of(index) if cls._schedule else time.time()
        # Past the end of the run nothing is sent; open loop counts the slots it could not send as unsent.
        if self.options.run_for and max(due, time.time()) >= _TEST_START[0] + self.options.run_for:
            raise StopUser
        if self.options.samples_file and Path(self.options.samples_file).with_name(STOP_FILE).exists():
            raise StopUser  # the runner's window holds the requests it asked for
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
        if options.ignore_eos or request.ignore_eos:
            body["ignore_eos"] = True
        path = "/v1/chat/completions"
        if request.messages is not None:
            body["messages"] = request.messages
        else:
            # vLLM's completions API takes a prompt as text or as a list of token ids.
            prompt = request.prompt if request.prompt_token_ids is None else request.prompt_token_ids
            path, body["prompt"] = "/v1/completions", prompt
        # Measure from the intended send time: perf_counter's origin shifted back by any lateness.
        sent = time.time()
        origin = time.perf_counter() - (sent - intended)
        error: Exception | None = None
        stopping: BaseException | None = None
        result = openai_client.StreamResult()
        seconds, late = self._time_allowed(sent)
        try:
            # A total deadline: httpx's timeout is per read, and a server that keeps sending never trips it.
            with gevent.Timeout(seconds, NoAnswerInTime(late)):
                result = self._stream(path, body, origin, completions.answer_cap(request.max_tokens))
        except Exception as exc:  # noqa: BLE001 - every request becomes a sample: an error says what broke
            error = exc
            result.e2e = time.perf_counter() - origin
        except gevent.GreenletExit as exc:  # Locust stopping this user mid-request: counted, then it stops
            error, stopping = StoppedMidAnswer("the load generator stopped before the answer ended"), exc
            result.e2e = time.perf_counter() - origin
        if stopping is None:
            # A request cut by the run's end is no failure of the server: Locust's own users do not count
            # one either (a step shape's last step would always end in failures). kvtune's samples keep it.
            self.environment.events.request.fire(
                request_type="POST",
                name=name,
                response_time=result.e2e * 1000,
                response_length=result.completion_tokens or 0,
                exception=error,
                context={},
            )
        if error is None and result.ttft is not None:
            # Float milliseconds, as Locust's own request events pass them (its annotation says int).
            TOKEN_STATS.log_request(TTFT, name, result.ttft * 1000, 0)  # type: ignore[arg-type]
            for gap in itl_gaps(result.token_times):
                TOKEN_STATS.log_request(ITL, name, gap * 1000, 0)  # type: ignore[arg-type]
            if isinstance(cls._workload, MultiTurn):
                cls._workload.record_answer(self.conversation, result.text, result.completion_tokens or 0)
        if cls._samples is not None:
            record = sample_record(request, result, intended, error) | {"sent": sent}
            cls._samples.write(json.dumps(record) + "\n")
        if stopping is not None:
            raise stopping

    def _stream(
        self, path: str, body: dict[str, Any], origin: float, max_bytes: int
    ) -> openai_client.StreamResult:
        with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raise AnswerRefused(f"HTTP {response.status_code}: {_excerpt(response)}")
            # Read raw: httpx inflates each network read whole, and a compressed stream was not asked for.
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise completions.BadAnswer(
                    f"the answer came in Content-Encoding {shown_text(encoding, 40)!r}, not asked for"
                )
            return completions.read_completion(
                response.iter_raw(), origin, time.perf_counter, max_bytes=max_bytes
            )

    def _time_allowed(self, sent: float) -> tuple[float, str]:
        """Seconds this request may take, and what a request that takes longer is told.

        --request-timeout bounds each request; --finish-within bounds them all to that long after --run-for
        (the runner stops waiting then, and a request still running must be counted, not dropped).
        """
        options = self.options
        seconds = options.request_timeout
        late = f"no complete answer within {seconds:g} s (--request-timeout)"
        if options.run_for and options.finish_within:
            left = _TEST_START[0] + options.run_for + options.finish_within - sent
            if left < seconds:
                seconds = max(left, 0.001)
                late = f"no complete answer {options.finish_within:g} s after the run's last request was due"
        return seconds, late


class StoppedMidAnswer(RuntimeError):
    """Locust stopped the user while its request was in flight (the run's end came first)."""


class NoAnswerInTime(RuntimeError):
    """A request's deadline passed before its answer ended."""


class AnswerRefused(RuntimeError):
    """The server answered with an HTTP error; str() holds its status and the start of its body."""


def _excerpt(response: httpx.Response) -> str:
    """The start of an error answer, read no further: an error page may be endless."""
    head = b""
    for chunk in response.iter_raw():
        head += chunk
        if len(head) >= _EXCERPT_BYTES:
            break
    return shown_text(head[:_EXCERPT_BYTES].decode(errors="replace")) or "(no body)"


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
        "trace_index": request.trace_index,
        "cut_prompt_tokens": request.cut_prompt_tokens,
        "cut_output_tokens": request.cut_output_tokens,
        "error": None if error is None else shown_text(f"{error.__class__.__name__}: {error}"),
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
        # Atomic: the runner polls for the marker and must never read it half-written (empty).
        write_atomic(_marker(options.samples_file, ".started"), repr(_TEST_START[0]))


def _end_test(environment: Environment) -> None:
    """A workload's last request is answered: end the test as a load shape that returns None does."""
    runner = environment.runner
    if runner is None or runner.state not in (STATE_RUNNING, STATE_SPAWNING):
        return
    log.info("every request of the workload is answered: the test ends")
    options = environment.parsed_options
    if options is not None and options.headless:
        runner.quit()
    else:
        runner.stop()


@events.test_start.add_listener
def _new_run(environment: Environment, **_kwargs: Any) -> None:
    """A new test from the web UI replays a workload with an end from its start, on a new clock."""
    for user_class in environment.user_classes:
        if issubclass(user_class, LLMUser):
            user_class._counter, user_class._ended = itertools.count(), False
            if user_class._schedule is not None:
                user_class._schedule.reset()


_REUSE_COUNTERS = (metrics.PREFIX_CACHE_HITS, metrics.PREFIX_CACHE_QUERIES)
_counters_at_start: dict[str, float] = {}


def _reuse_counters(host: str) -> dict[str, float]:
    """The engine's prefix-cache counters now; empty when its /metrics cannot be read as Prometheus text."""
    try:
        with http_client.new_client(auth_headers()) as client:
            response = http_client.get(client, f"{host.rstrip('/')}/metrics", deadline_s=DISCOVERY_DEADLINE_S)
        response.raise_for_status()
        samples = metrics.parse(response.content.decode("utf-8"))
    except (httpx.HTTPError, ValueError):  # UnicodeDecodeError and the parser's errors are ValueErrors
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
    hits, queries = (
        counter_increase(_counters_at_start.get(n, 0.0), end.get(n, 0.0)) for n in _REUSE_COUNTERS
    )
    targets = [
        user_class._workload.describe().get("target_reuse")
        for user_class in environment.user_classes
        if issubclass(user_class, LLMUser) and user_class._workload is not None
    ]
    target = f"{targets[0]:.1%}" if targets and targets[0] is not None else "not set by this workload"
    rate = metrics.hit_rate(hits, queries)
    achieved = "no prompts" if rate is None else f"{rate:.1%} ({hits:.0f} of {queries:.0f} prompt tokens)"
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
