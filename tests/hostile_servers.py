"""A local HTTP server that answers like a broken or hostile one, for testing kvtune's clients.

    with HostileServer() as server:
        server.route("/metrics", slow_loris(interval_s=1.0))
        server.route("/v1/models", json_reply([1, 2, 3]))       # a list where an object belongs
        run_the_client(server.url)

It binds 127.0.0.1 on a free port; each path answers with the route set for it (404 otherwise), and a route
can be changed at any time. Routes that never end on their own (a slow-loris, an endless body) end when the
client goes away or the server stops: leaving the `with` block ends every connection and joins every
thread, so a test leaves nothing running. The routes are generic (slow, endless, huge, compressed, wrong
JSON, invalid UTF-8, redirects); the vLLM-shaped bodies at the end build /metrics texts that break the
exposition format in the ways a real engine or a proxy in front of it could.
"""

from __future__ import annotations

import functools
import gzip
import json
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from kvtune import metrics

# A handler blocked writing to a client that stopped reading gives up after this long, so `stop()` can
# always join its thread.
SEND_TIMEOUT_S = 5.0
CHUNK_BYTES = 64 * 1024
MIB = 2**20


@dataclass(frozen=True)
class Request:
    """What a client asked: recorded for every request, in order, on `HostileServer.requests`."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes


class Exchange:
    """One request being answered: what was asked, and the means to answer it slowly or for ever.

    `write` and `pause` return False once the client has gone away or the server is stopping: a route that
    loops must then return.
    """

    def __init__(self, handler: BaseHTTPRequestHandler, request: Request, stopping: threading.Event) -> None:
        self._handler = handler
        self.request = request
        self.stopping = stopping
        self._chunked = False
        self._gone = False

    def start(
        self,
        status: int,
        headers: Mapping[str, str] | None = None,
        length: int | None = None,
        chunked: bool = True,
    ) -> None:
        """The status line and headers. Without `length` the body may never end: it is sent chunked, or
        (chunked False) as bytes until the connection closes, as an HTTP/1.0 server would."""
        self._handler.send_response(status)
        for name, value in (headers or {}).items():
            self._handler.send_header(name, value)
        if length is not None:
            self._handler.send_header("Content-Length", str(length))
        elif chunked:
            self._chunked = True
            self._handler.send_header("Transfer-Encoding", "chunked")
        else:
            self._handler.send_header("Connection", "close")
            self._handler.close_connection = True
        self._handler.end_headers()

    def write(self, data: bytes) -> bool:
        if self._gone or self.stopping.is_set():
            return False
        try:
            if self._chunked:
                self._handler.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            else:
                self._handler.wfile.write(data)
            self._handler.wfile.flush()
        except OSError:  # the client went away (reset, broken pipe) or stopped reading (timeout)
            self._gone = True
            return False
        return True

    def finish(self) -> None:
        """End a chunked body (a route that returns without it leaves the client waiting for more)."""
        if self._chunked:
            self.write(b"")

    def pause(self, seconds: float) -> bool:
        return not self.stopping.wait(seconds)

    def reply(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        """A complete answer with its length."""
        self.start(status, headers, length=len(body))
        self.write(body)


Route = Callable[[Exchange], None]


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients here cut bodies short and drop connections on purpose: only real faults are printed.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class HostileServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 and a free port; a context manager that stops it cleanly."""

    def __init__(self) -> None:
        self._routes: dict[str, Route] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.requests: list[Request] = []
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        # Handler threads are joined at stop (not daemons): nothing outlives the test.
        self._server.daemon_threads = False
        self._server.block_on_close = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hostile-server", daemon=True)
        self._started = False

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def route(self, path: str, route: Route) -> None:
        """Answer `path` (without its query) with `route` from now on."""
        with self._lock:
            self._routes[path] = route

    def count(self, path: str) -> int:
        """How many requests `path` has had."""
        with self._lock:
            return sum(request.path == path for request in self.requests)

    def start(self) -> HostileServer:
        if not self._started:
            self._thread.start()
            self._started = True
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._started:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()  # joins every handler thread

    def __enter__(self) -> HostileServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = SEND_TIMEOUT_S

            def _answer(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(
                    self.command,
                    parts.path,
                    parse_qs(parts.query),
                    {name.lower(): value for name, value in self.headers.items()},
                    self.rfile.read(length) if length else b"",
                )
                with server._lock:
                    server.requests.append(request)
                    route = server._routes.get(parts.path)
                exchange = Exchange(self, request, server._stopping)
                if route is None:
                    exchange.reply(404, b'{"message": "not found"}', {"Content-Type": "application/json"})
                    return
                route(exchange)
                if exchange._chunked or server._stopping.is_set():
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


@pytest.fixture
def hostile_server() -> Iterator[HostileServer]:
    """A started HostileServer, stopped at the test's end (import this fixture into a test module)."""
    with HostileServer() as server:
        yield server


# ---- routes ----------------------------------------------------------------------------------------------


def raw(
    body: bytes, status: int = 200, content_type: str = "text/plain", headers: Mapping[str, str] | None = None
) -> Route:
    """Exactly these bytes (invalid UTF-8, HTML, anything), with a correct Content-Length."""

    def route(exchange: Exchange) -> None:
        exchange.reply(status, body, {"Content-Type": content_type, **(headers or {})})

    return route


def text(body: str, status: int = 200, content_type: str = "text/plain; version=0.0.4") -> Route:
    """A text body (an exposition text by default)."""
    return raw(body.encode(), status, content_type)


def json_reply(body: Any, status: int = 200) -> Route:
    """Any JSON value: a list where an object belongs, an object of wrong types, a string, a number."""
    return raw(json.dumps(body).encode(), status, "application/json")


def sequence(*routes: Route) -> Route:
    """The first request gets the first route, the next the second, ...; the last repeats (an engine whose
    counters change between scrapes, or one that restarts mid-window)."""
    lock = threading.Lock()
    served = 0

    def route(exchange: Exchange) -> None:
        nonlocal served
        with lock:
            chosen = routes[min(served, len(routes) - 1)]
            served += 1
        chosen(exchange)

    return route


def slow_loris(
    interval_s: float = 1.0,
    status: int = 200,
    content_type: str = "text/plain",
    byte: bytes = b"#",
    chunked: bool = True,
) -> Route:
    """Headers at once, then one byte every `interval_s` for ever: every socket read succeeds in time,
    only a total deadline ends it. With `chunked` False the body has no framing at all (it ends when the
    connection does): a client that waits to fill a buffer before checking its clock never checks it."""

    def route(exchange: Exchange) -> None:
        exchange.start(status, {"Content-Type": content_type}, chunked=chunked)
        while exchange.write(byte) and exchange.pause(interval_s):
            pass

    return route


def silent(status: int | None = None) -> Route:
    """Never answers (status None), or sends the headers of `status` and then nothing: a read timeout."""

    def route(exchange: Exchange) -> None:
        if status is not None:
            exchange.start(status, {"Content-Type": "text/plain"})
            exchange.write(b"")  # the headers go out; the (chunked) body never comes
        while exchange.pause(0.5):
            pass

    return route


def endless_body(
    content_type: str = "text/plain", chunk: bytes = b"#" * CHUNK_BYTES, chunked: bool = True
) -> Route:
    """A body that never ends (chunked, or unframed until the connection closes), as fast as it is read."""

    def route(exchange: Exchange) -> None:
        exchange.start(200, {"Content-Type": content_type}, chunked=chunked)
        while exchange.write(chunk):
            pass

    return route


def huge_body(size_bytes: int, content_type: str = "text/plain", fill: bytes = b"#") -> Route:
    """A body of `size_bytes` with its Content-Length, sent as fast as the client reads it."""
    block = fill * (CHUNK_BYTES // len(fill))

    def route(exchange: Exchange) -> None:
        exchange.start(200, {"Content-Type": content_type}, length=size_bytes)
        left = size_bytes
        while left > 0 and exchange.write(block[:left]):
            left -= min(len(block), left)

    return route


@functools.cache
def gzip_bomb_bytes(decoded_bytes: int) -> bytes:
    """`decoded_bytes` zero bytes, gzipped: 1 GiB is about 1 MiB on the wire (built once per size)."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(MIB)
    parts = [
        compressor.compress(zeros[: min(MIB, decoded_bytes - start)])
        for start in range(0, decoded_bytes, MIB)
    ]
    return b"".join([*parts, compressor.flush()])


def gzip_bomb(decoded_bytes: int = 1024 * MIB, content_type: str = "text/plain", layers: int = 1) -> Route:
    """A small body that inflates to `decoded_bytes` (Content-Encoding: gzip). With `layers` 2 it is
    gzipped twice and says so (`gzip, gzip`): a client that decodes both inflates it a thousand times more."""
    body = gzip_bomb_bytes(decoded_bytes)
    for _ in range(layers - 1):
        body = gzip.compress(body, 9)
    encoding = ", ".join(["gzip"] * layers)
    return raw(body, 200, content_type, {"Content-Encoding": encoding})


def redirect(location: str, status: int = 302) -> Route:
    """A redirect (to another host, say): a client that follows it sends its credentials there."""

    def route(exchange: Exchange) -> None:
        exchange.reply(status, b"", {"Location": location})

    return route


def recorded(route: Route, seen: list[Request]) -> Route:
    """`route`, appending each request it answers to `seen` (the other host of a redirect, say)."""

    def wrapped(exchange: Exchange) -> None:
        seen.append(exchange.request)
        route(exchange)

    return wrapped


# ---- vLLM-shaped /metrics bodies -------------------------------------------------------------------------

HTML_MENTIONING_VLLM = (
    "<!doctype html><html><head><title>vLLM dashboard</title></head><body>"
    "<h1>Sign in</h1><p>Metrics such as vllm:num_requests_running and vllm:kv_cache_usage_perc are "
    "behind this login.</p></body></html>\n"
)

# The labels of vLLM 0.32's `vllm:cache_config_info` the doctor reads; the others do not matter here.
POOL_LABELS: dict[str, str] = {
    "block_size": "16",
    "cache_dtype": "auto",
    "enable_prefix_caching": "True",
    "num_gpu_blocks": "728",
    "num_gpu_blocks_override": "None",
    "kv_cache_size_tokens": "11648",
    "kv_cache_memory_bytes": str(256 * MIB),
    "gpu_memory_utilization": "0.92",
    "engine": "0",
}
TTFT_BOUNDS = ("0.1", "0.5", "1.0", "2.5", "+Inf")


@dataclass(frozen=True)
class VllmMetrics:
    """The metrics the doctor reads, as vLLM renders them; every value is a string so it can be "+Inf",
    "NaN" or anything else an exposition line may carry."""

    hits: str = "900"
    queries: str = "1000"
    preemptions: str = "0"
    prompt_tokens: str = "1000"
    generation_tokens: str = "200"
    finished: str = "5"
    kv_usage: str = "0.3"
    running: str = "1"
    waiting: str = "0"
    ttft_buckets: Sequence[tuple[str, str]] = tuple(zip(TTFT_BOUNDS, ("1", "4", "5", "5", "5"), strict=True))
    ttft_sum: str = "1.5"
    ttft_count: str = "5"
    pool: Mapping[str, str] = field(default_factory=lambda: dict(POOL_LABELS))

    def text(self) -> str:
        labels = 'model_name="m",engine="0"'

        def family(name: str, kind: str, *lines: str) -> list[str]:
            return [f"# HELP {name} {name}", f"# TYPE {name} {kind}", *lines]

        def counter(name: str, value: str) -> list[str]:
            return family(name, "counter", f"{name}{{{labels}}} {value}")

        def gauge(name: str, value: str) -> list[str]:
            return family(name, "gauge", f"{name}{{{labels}}} {value}")

        pool = ",".join(f'{key}="{value}"' for key, value in self.pool.items())
        ttft = metrics.TTFT_SECONDS
        lines = [
            *family(metrics.CACHE_CONFIG_INFO, "gauge", f"{metrics.CACHE_CONFIG_INFO}{{{pool}}} 1.0"),
            *counter(metrics.PREFIX_CACHE_HITS, self.hits),
            *counter(metrics.PREFIX_CACHE_QUERIES, self.queries),
            *counter(metrics.PREEMPTIONS, self.preemptions),
            *counter(metrics.PROMPT_TOKENS, self.prompt_tokens),
            *counter(metrics.GENERATION_TOKENS, self.generation_tokens),
            *counter(metrics.REQUEST_SUCCESS, self.finished),
            *gauge(metrics.KV_CACHE_USAGE, self.kv_usage),
            *gauge(metrics.REQUESTS_RUNNING, self.running),
            *gauge(metrics.REQUESTS_WAITING, self.waiting),
            *family(
                ttft,
                "histogram",
                *(f'{ttft}_bucket{{{labels},le="{bound}"}} {count}' for bound, count in self.ttft_buckets),
                f"{ttft}_sum{{{labels}}} {self.ttft_sum}",
                f"{ttft}_count{{{labels}}} {self.ttft_count}",
            ),
        ]
        return "\n".join(lines) + "\n"


def vllm_metrics(**values: Any) -> Route:
    """/metrics of a vLLM engine with the given values (see VllmMetrics), the same at every scrape."""
    return text(VllmMetrics(**values).text())


def non_finite_counter(value: str = "+Inf") -> Route:
    """The prefix-cache hit counter at +Inf (or NaN): counters are finite; only a bucket's `le` is +Inf."""
    return vllm_metrics(hits=value)


def non_finite_gauge(value: str = "NaN") -> Route:
    return vllm_metrics(kv_usage=value)


def bad_bucket_bound(bound: str = "abc") -> Route:
    """A TTFT bucket whose `le` is not a number."""
    buckets = (("0.1", "1"), (bound, "4"), ("+Inf", "5"))
    return vllm_metrics(ttft_buckets=buckets)


def infinite_pool(label: str = "num_gpu_blocks", value: str = "inf") -> Route:
    """`vllm:cache_config_info` with a label that should be a whole number saying "inf"."""
    return vllm_metrics(pool=POOL_LABELS | {label: value})


def restart_mid_window() -> Route:
    """A busy engine at the first scrape, then restarted (its counters from zero) at every later one: an
    increase taken naively across the restart gives a 900% hit rate."""
    before = VllmMetrics(hits="100", queries="1000", prompt_tokens="1000", finished="5")
    once = tuple((bound, "1") for bound in TTFT_BOUNDS)
    after = VllmMetrics(
        hits="90", queries="1010", prompt_tokens="10", finished="1", ttft_buckets=once, ttft_count="1"
    )
    return sequence(text(before.text()), text(after.text()))


INVALID_UTF8 = b"# HELP vllm:num_requests_running \xff\xfe running\nvllm:num_requests_running 1\n"
