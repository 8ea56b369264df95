"""`kvtune load` against servers that stall, flood, lie about their shape or stream nonsense; and its secrets.

Every run is the real command in a subprocess (Locust as its child) against tests/hostile_servers.py. A server
that fails the check ends the command with exit 2, one line on stderr and no traceback, within a deadline
and a bounded memory (the peak RSS of every process the command started, from the kernel's rusage). A server
whose completions cannot be read makes every one of them an error with its reason, none dropped. A URL
password and an API key show in no output, no Locust command line and no file the run writes. Prompts are
sized with a tiny word-level tokenizer the fake model list names as its root: no model, no engine.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtune import http_client
from kvtune.commands import load as load_command
from kvtune.commands.load import UsageError
from kvtune.loadgen import runner
from kvtune.loadgen.completions import BadAnswer, answer_cap, read_completion
from kvtune.loadgen.runner import LoadSpec, ServerError
from kvtune.loadgen.text import _WORDS
from kvtune.loadgen.workload_args import API_KEY_ENV
from tests.hostile_servers import (
    HTML_MENTIONING_VLLM,
    INVALID_UTF8,
    MIB,
    Exchange,
    HostileServer,
    Route,
    endless_body,
    gzip_bomb,
    hostile_server,
    json_reply,
    non_finite_counter,
    non_finite_gauge,
    raw,
    redirect,
    slow_loris,
    text,
    vllm_metrics,
)
from tests.peak_rss import measured, read_report

__all__ = ["hostile_server"]  # the fixture, imported for pytest

# Generous bounds for a busy 2-core host: a check's worst case is its 10 s deadline plus a 10 s read.
CHECK_RUN_S = 60.0
LOAD_RUN_S = 120.0
# Python with kvtune's imports, or Locust with a tokenizer, is ~100-250 MB; a body read whole is GBs.
PEAK_RSS_BOUND = 1024 * MIB
SMALL = ["--arg", "system-tokens=16", "--arg", "user-tokens=8", "--max-tokens", "4", "--warmup", "0"]


@pytest.fixture(scope="module")
def tokenizer_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a word-level tokenizer.json over the prompt maker's words (built in ~0.1 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, ".": 1}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


# ---- running the command -----------------------------------------------------------------------------------


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    elapsed_s: float
    peak_rss: int  # bytes, the largest of the command's processes
    # every command line of the processes the command started, as seen while it ran
    command_lines: set[str] = field(default_factory=set)

    @property
    def locust_command_lines(self) -> set[str]:
        return {line for line in self.command_lines if " locust " in line}

    @property
    def error_line(self) -> str:
        return " ".join(self.stderr.split())  # rich wraps long lines on a narrow terminal


def kvtune_load(
    tmp_path: Path, *argv: str, env: dict[str, str] | None = None, deadline_s: float = CHECK_RUN_S
) -> Run:
    """`kvtune load ARGV` to its end, or stopped (and the test failed) past `deadline_s`."""
    report = tmp_path / "measured.json"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    base = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {"COLUMNS": "200"}
    command = measured([sys.executable, "-m", "kvtune.cli", "load", *argv], report)
    start = time.monotonic()
    seen: dict[int, set[str]] = {}
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            command, stdout=stdout, stderr=stderr, env=base | (env or {}), start_new_session=True
        )
        try:
            while proc.poll() is None and time.monotonic() - start < deadline_s:
                for pid, line in _descendants(proc.pid).items():
                    seen.setdefault(pid, set()).add(line)
                time.sleep(0.1)
        finally:
            hung = proc.poll() is None
            if hung:
                _stop(proc, seen)
    elapsed = time.monotonic() - start
    assert not hung, f"kvtune load still running after {deadline_s:.0f} s: {err.read_text()[-2000:]}"
    code, peak_rss = read_report(report)
    lines = {line for found in seen.values() for line in found if line}
    return Run(code, out.read_text(), err.read_text(), elapsed, peak_rss, lines)


def _descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live process under `root` (Locust runs in a session of its own)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                with contextlib.suppress(OSError):
                    found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    frontier.append(pid)
    return found


def _stop(proc: subprocess.Popen[bytes], seen: dict[int, set[str]]) -> None:
    """SIGTERM the command (it stops Locust on its way out), then SIGKILL whatever it started and left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    for pid in [proc.pid, *seen]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def assert_refused(run: Run, *expected: str) -> None:
    """Exit 2, one `error:` line, no traceback, within the deadline and the memory bound."""
    assert run.code == 2, (run.code, run.stdout, run.stderr)
    assert "Traceback" not in run.stderr, run.stderr
    assert run.error_line.startswith("error: --url "), run.stderr
    assert len(run.stderr.strip().splitlines()) <= 3, run.stderr  # one line, wrapped at most
    for part in expected:
        assert part in run.error_line, (part, run.error_line)
    assert run.peak_rss < PEAK_RSS_BOUND, f"peak RSS {run.peak_rss / MIB:.0f} MiB"


# ---- a fake OpenAI server ----------------------------------------------------------------------------------

MODEL = "tiny"


def serve_openai(server: HostileServer, tokenizer_root: str, completions: Route) -> None:
    """A model list naming the tiny tokenizer, vLLM's metrics, and `completions` for every chat request."""
    server.route(
        "/v1/models", json_reply({"object": "list", "data": [{"id": MODEL, "root": tokenizer_root}]})
    )
    server.route("/metrics", vllm_metrics())
    server.route("/v1/chat/completions", completions)


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def content(piece: object) -> dict[str, object]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": piece}}]}


COUNTS: dict[str, object] = {"prompt_tokens": 24, "completion_tokens": 4}
USAGE = {"choices": [], "usage": COUNTS}


def streamed(*events: bytes, every_s: float = 0.0) -> Route:
    """A text/event-stream answer made of `events`, sent `every_s` apart."""

    def route(exchange: Exchange) -> None:
        exchange.start(200, {"Content-Type": "text/event-stream"})
        for part in events:
            if not (exchange.write(part) and exchange.pause(every_s)):
                return
        exchange.finish()

    return route


GOOD = streamed(*(event(content(f"w{i} ")) for i in range(4)), event(USAGE), b"data: [DONE]\n\n")


def never_ending(every_s: float) -> Route:
    """Content chunks for ever, `every_s` apart: only a deadline on the whole request ends it."""

    def route(exchange: Exchange) -> None:
        exchange.start(200, {"Content-Type": "text/event-stream"})
        while exchange.write(event(content("more "))) and exchange.pause(every_s):
            pass

    return route


def rotating(*routes: Route) -> Route:
    """Request n gets routes[n % len(routes)]: every kind of answer keeps coming for the whole run."""
    lock = threading.Lock()
    served = 0

    def route(exchange: Exchange) -> None:
        nonlocal served
        with lock:
            chosen = routes[served % len(routes)]
            served += 1
        chosen(exchange)

    return route


# ---- servers that fail the check: refused before any load --------------------------------------------------

GOOD_MODELS = json_reply({"data": [{"id": MODEL}]})

# Each kind of server the command meets as a real subprocess (the ways it used to hang, grow or traceback);
# the many wrong shapes are checked in-process below.
REFUSED: dict[str, tuple[dict[str, Route], str]] = {
    "slow-models": ({"/v1/models": slow_loris(interval_s=0.5)}, "/v1/models was still sending after 10 s"),
    "slow-metrics": ({"/metrics": slow_loris(interval_s=0.5)}, "/metrics was still sending after 10 s"),
    "endless-metrics": ({"/metrics": endless_body()}, "/metrics sent more than 4 MiB"),
    "gzip-bomb-metrics": ({"/metrics": gzip_bomb(1024 * MIB)}, "/metrics sent more than 4 MiB"),
    "html-mentioning-vllm": (
        {"/metrics": text(HTML_MENTIONING_VLLM, content_type="text/html")},
        "/metrics is not Prometheus text",
    ),
    "invalid-utf8-metrics": ({"/metrics": raw(INVALID_UTF8)}, "/metrics is not UTF-8 text"),
    "models-as-a-list": (
        {"/v1/models": json_reply([{"id": MODEL}])},
        "/v1/models is not an OpenAI model list (no `data` array)",
    ),
    "redirect": (
        {"/v1/models": redirect("http://198.51.100.7/v1/models")},
        "a redirect to 'http://198.51.100.7",
    ),
}


def run_together(*runs: tuple[Path, list[str], dict[str, str] | None, float]) -> list[Run]:
    """Several `kvtune_load(tmp, *argv, env=env, deadline_s=deadline)` at once: most of their time is
    starting Python or waiting on a server, and the file must stay quick."""
    with ThreadPoolExecutor(max_workers=len(runs)) as pool:
        futures = [
            pool.submit(kvtune_load, folder, *argv, env=env, deadline_s=deadline)
            for folder, argv, env, deadline in runs
        ]
        return [future.result() for future in futures]


def test_hostile_servers_are_refused_quickly_and_cheaply(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, (routes, _expected) in REFUSED.items():
            server = servers[name] = stack.enter_context(HostileServer())
            server.route("/v1/models", GOOD_MODELS)
            server.route("/metrics", vllm_metrics())
            for path, route in routes.items():
                server.route(path, route)
            (tmp_path / name).mkdir()
        runs = run_together(
            *(
                (tmp_path / name, ["--url", server.url, "--keep-samples", str(tmp_path / name), *SMALL], None,
                 CHECK_RUN_S)
                for name, server in servers.items()
            )
        )  # fmt: skip
        loaded = {name: server.count("/v1/chat/completions") for name, server in servers.items()}
    for (name, (_routes, expected)), run in zip(REFUSED.items(), runs, strict=True):
        assert_refused(run, expected)
        assert run.elapsed_s < CHECK_RUN_S, (name, run.elapsed_s)
        assert loaded[name] == 0, name  # checked, never loaded
        assert not run.locust_command_lines, name  # no load started


@pytest.mark.parametrize(
    ("routes", "expected"),
    [
        ({"/v1/models": json_reply({"data": {"id": MODEL}})}, "(no `data` array)"),
        ({"/v1/models": json_reply({"data": [{"id": 5}]})}, "(an entry without a string `id`)"),
        ({"/v1/models": json_reply({"data": ["m"]})}, "(an entry without a string `id`)"),
        ({"/v1/models": json_reply({"data": []})}, "serves no model"),
        ({"/v1/models": raw(b'{"data": [{"id": "m", "x": NaN}]}')}, "(not JSON: NaN is not a JSON number)"),
        ({"/v1/models": raw(b'{"data": [{"id": "\xff"}]}')}, "(not JSON"),
        ({"/v1/models": raw(b"<html>OpenAI</html>", content_type="text/html")}, "(not JSON"),
        ({"/v1/models": redirect("http://u:secret@elsewhere/x")}, "a redirect to 'http://u:***@elsewhere/x'"),
        ({"/metrics": text("# HELP x y\n", content_type="text/plain")}, "/metrics has no vllm: metric"),
        ({"/metrics": text(HTML_MENTIONING_VLLM)}, "/metrics is not Prometheus text"),
        ({"/metrics": non_finite_counter("+Inf")}, "gives vllm:prefix_cache_hits_total is +Inf"),
        ({"/metrics": non_finite_gauge("NaN")}, "gives vllm:kv_cache_usage_perc is NaN"),
        # Prometheus text whose numbers no one engine exports together: said so, not "not Prometheus text".
        ({"/metrics": vllm_metrics(hits="5000")}, "cannot come from one vLLM engine"),
        ({"/metrics": vllm_metrics(kv_usage="1.5")}, "vllm:kv_cache_usage_perc"),
        ({"/metrics": slow_loris(interval_s=0.2)}, "/metrics was still sending after"),
    ],
)
def test_the_check_reads_a_model_list_and_vllm_metrics_strictly(
    routes: dict[str, Route], expected: str, hostile_server: HostileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "CHECK_DEADLINE_S", 1.0)
    hostile_server.route("/v1/models", GOOD_MODELS)
    hostile_server.route("/metrics", vllm_metrics())
    for path, route in routes.items():
        hostile_server.route(path, route)
    with http_client.new_client() as client, pytest.raises(ServerError) as refused:
        runner.check_server(LoadSpec(url=hostile_server.url), client)
    assert expected in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_check_passes_a_vllm_server(hostile_server: HostileServer) -> None:
    hostile_server.route("/v1/models", GOOD_MODELS)
    hostile_server.route("/metrics", vllm_metrics())
    with http_client.new_client() as client:
        runner.check_server(LoadSpec(url=hostile_server.url, model=MODEL), client)


# ---- completions the client cannot read: each an error with its reason -------------------------------------


def error_page() -> Route:
    """HTTP 503 with an HTML body that never ends: its start is the reason, the rest is not read."""

    def route(exchange: Exchange) -> None:
        exchange.start(503, {"Content-Type": "text/html"})
        exchange.write(b"<html><body>upstream down")
        while exchange.write(b" and down" * 1000):
            pass

    return route


# Every kind of answer a client cannot read as a completion, and the reason its requests fail with.
UNREADABLE: list[tuple[Route, str]] = [
    (
        streamed(event([content("a")]), b"data: [DONE]\n\n"),
        "a chunk is a JSON array, where an object belongs",
    ),
    (json_reply({"choices": [{"message": {"content": "ok"}}]}), "not a server-sent-event stream"),
    (
        streamed(event({"choices": {"0": {"delta": {"content": "a"}}}}), b"data: [DONE]\n\n"),
        "a chunk's `choices` is a JSON object, not an array",
    ),
    (
        streamed(event({"choices": [{"index": 0, "text": 5}]}), b"data: [DONE]\n\n"),
        "a choice's `text` is a JSON number, not a string",
    ),
    (
        streamed(
            event(content("a")),
            b'data: {"choices": [], "usage": {"prompt_tokens": NaN}}\n\n',
            b"data: [DONE]\n\n",
        ),
        "a chunk holds NaN, which is not a JSON number",
    ),
    (never_ending(every_s=0.1), "no complete answer within 3 s (--request-timeout)"),
    (never_ending(every_s=0.0), "more than its max_tokens can take"),
    (streamed(event(content("a")), event(USAGE)), "the stream ended before `data: [DONE]`"),
    (error_page(), "HTTP 503: <html><body>upstream down and down"),
    (gzip_bomb(64 * MIB, content_type="text/event-stream"), "Content-Encoding 'gzip', not asked for"),
]


def test_answers_that_are_not_completions_are_errors_with_their_reasons(
    hostile_server: HostileServer, tokenizer_root: str, tmp_path: Path
) -> None:
    serve_openai(hostile_server, tokenizer_root, rotating(*(route for route, _reason in UNREADABLE)))
    out = tmp_path / "result.json"
    run = kvtune_load(
        tmp_path, "--url", hostile_server.url, "--users", "2", "--duration", "8", "--request-timeout", "3",
        "--keep-samples", str(tmp_path), "--json", str(out), *SMALL, deadline_s=LOAD_RUN_S,
    )  # fmt: skip
    assert "Traceback" not in run.stderr, run.stderr
    assert run.code == 1, (run.code, run.stdout, run.stderr)  # it ran; every request failed
    result = json.loads(out.read_text())
    assert result["requests"] == 0 and result["errors"] > 0, result
    assert f"0 requests ({result['errors']} errors)" in " ".join(run.stdout.split())
    assert "failed: " in run.stderr  # the reasons are shown, not only counted
    samples = read_samples(tmp_path)
    # Every request the server answered became a sample, every one an error naming its reason. Only the
    # requests in flight when the run's end stopped Locust (at most one per user) may differ: cut before
    # they reached the server (a sample saying so), or killed with their process (no sample) when a busy
    # host's stop came before their deadline.
    cut = [sample for sample in samples if "stopped before the answer ended" in str(sample["error"])]
    # A request sent on a kept-alive connection the server was closing (after an answer it cut short) never
    # reaches it: an error sample of its own, with the client's reason, that the server did not count.
    unsent = [
        sample
        for sample in samples
        if "Server disconnected without sending a response" in str(sample["error"])
    ]
    answered = [sample for sample in samples if sample not in cut and sample not in unsent]
    received = hostile_server.count("/v1/chat/completions")
    assert len(cut) <= 2 and received - 2 <= len(answered) <= received, (len(cut), len(answered), received)
    assert len(unsent) <= len(answered) // 4, (len(unsent), len(answered))  # now and then, not the rule
    errors = {str(sample["error"]) for sample in answered}
    reasons = [reason for _route, reason in UNREADABLE]
    for reason in reasons:
        assert any(reason in error for error in errors), (reason, errors)
    assert all(any(reason in error for reason in reasons) for error in errors), errors
    assert run.peak_rss < PEAK_RSS_BOUND, f"peak RSS {run.peak_rss / MIB:.0f} MiB"


def read_samples(folder: Path) -> list[dict[str, object]]:
    return [
        json.loads(line)
        for path in folder.glob("kvtune-load-*/samples.*.jsonl")
        for line in path.read_text().splitlines()
    ]


def chunks_of(route_body: bytes, size: int = 7) -> list[bytes]:
    """A body cut in small pieces, as a network may deliver it (a line split across reads)."""
    return [route_body[i : i + size] for i in range(0, len(route_body), size)]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"data: {}\n\n", "the stream ended before `data: [DONE]`"),
        (b"data: [DONE]\n\n", "the stream ended without any text"),
        (b"", "the body held no `data:` event"),
        (b"<html>\n", "not a server-sent-event stream"),
        (event(content("a")) + b"oops\n", "not an event stream"),
        (b'data: {"choices": [1]}\n', "a chunk's choice is a JSON number, not an object"),
        (b'data: {"choices": [{"delta": "a"}]}\n', "a choice's `delta` is a JSON string, not an object"),
        (b'data: {"choices": [{"delta": {"content": ["a"]}}]}\n', "`delta.content` is a JSON array"),
        (b'data: {"usage": [1]}\n', "a chunk's `usage` is a JSON array, not an object"),
        (
            b'data: {"usage": {"completion_tokens": -1}}\n',
            "`usage.completion_tokens` is -1, not a token count",
        ),
        (b'data: {"usage": {"completion_tokens": true}}\n', "is true, not a token count"),
        (b'data: {"usage": {"prompt_tokens": Infinity}}\n', "a chunk holds Infinity"),
        (b'data: {"error": {"message": "out of memory"}}\n', "reported an error mid-stream: out of memory"),
        (
            b'data: {"object": "error", "message": "bad request"}\n',
            "reported an error mid-stream: bad request",
        ),
        (b'data: {"x": "\xff"}\n', "the stream is not UTF-8 text"),
        (b"data: " + b"[" * 50_000 + b"\n", "a chunk is not JSON"),
        (b"data: " + b"x" * 70_000, "the answer ran past 64 KiB"),
    ],
    ids=lambda value: value[:40].decode(errors="replace") if isinstance(value, bytes) else None,
)
def test_a_stream_is_read_strictly(body: bytes, expected: str) -> None:
    with pytest.raises(BadAnswer) as refused:
        read_completion(chunks_of(body), 0.0, time.perf_counter, max_bytes=64 * 1024)
    assert expected in str(refused.value)


def test_a_vllm_stream_is_timed_and_counted() -> None:
    body = (
        b": ping\r\n\r\n"
        + event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        + b"".join(event(content(word)) for word in ("Hello", " world"))
        + event({"choices": [], "usage": COUNTS | {"prompt_tokens_details": {"cached_tokens": 16}}})
        + b"data: [DONE]\n\nanything after is not read"
    )
    ticks = iter(range(100))
    result = read_completion(chunks_of(body, 5), 0.0, lambda: float(next(ticks)), max_bytes=answer_cap(4))
    assert result.text == "Hello world" and result.ttft == 1.0 and result.token_times == [1.0, 2.0]
    assert (result.prompt_tokens, result.completion_tokens, result.cached_tokens) == (24, 4, 16)


# ---- secrets: a URL password and an API key ----------------------------------------------------------------

PASSWORD = "pw-7f3c9e1b2a"
KEY = "sk-live-4d5e6f7a8b9c"


def assert_secret_free(text: str, where: str) -> None:
    assert PASSWORD not in text, f"the URL password is in {where}"
    assert KEY not in text, f"the API key is in {where}"


def test_a_password_in_the_url_and_the_api_key_show_nowhere(tokenizer_root: str, tmp_path: Path) -> None:
    # One credential per request (kvtune.http_client): the URL's user and password (a proxy's Basic auth),
    # or the engine's key (Bearer); both together are refused before anything is sent.
    with HostileServer() as basic, HostileServer() as bearer, HostileServer() as both:
        for server in (basic, bearer):
            serve_openai(server, tokenizer_root, GOOD)
        both.route("/v1/models", GOOD_MODELS)
        url, both_url = (f"http://kvuser:{PASSWORD}@127.0.0.1:{s.port}" for s in (basic, both))
        folders = [tmp_path / name for name in ("basic", "bearer", "both")]
        for folder in folders:
            (folder / "kept").mkdir(parents=True)

        def argv(folder: Path, target: str) -> list[str]:
            return ["--url", target, "--duration", "3", "--keep-samples", str(folder / "kept"), "--json",
                    str(folder / "result.json"), *SMALL]  # fmt: skip

        runs = run_together(
            (folders[0], argv(folders[0], url), None, LOAD_RUN_S),
            (folders[1], argv(folders[1], bearer.url), {API_KEY_ENV: KEY}, LOAD_RUN_S),
            (folders[2], argv(folders[2], both_url), {API_KEY_ENV: KEY}, CHECK_RUN_S),
        )
        sent = {name: list(server.requests) for name, server in (("basic", basic), ("bearer", bearer))}
        asked_both = list(both.requests)
    for run, folder in zip(runs[:2], folders, strict=False):
        assert run.code == 0, (run.stdout, run.stderr)
        assert json.loads((folder / "result.json").read_text())["requests"] > 0
        assert run.locust_command_lines, f"the Locust process was not seen running: {run.command_lines}"
        assert list((folder / "kept").rglob("*.log")), "Locust's log was not kept"
    for run, folder in zip(runs, folders, strict=True):
        for where, written in [
            ("stdout", run.stdout),
            ("stderr", run.stderr),
            *(("Locust's command line", line) for line in run.locust_command_lines),
            *((str(path), path.read_text(errors="replace")) for path in folder.rglob("*") if path.is_file()),
        ]:
            assert_secret_free(written, where)
    # Each credential reached its server all the same (through Locust's environment), on every request.
    expected = "Basic " + base64.b64encode(f"kvuser:{PASSWORD}".encode()).decode()
    assert sent["basic"] and all(r.headers.get("authorization") == expected for r in sent["basic"])
    assert sent["bearer"] and all(r.headers.get("authorization") == f"Bearer {KEY}" for r in sent["bearer"])
    # Both at once: refused naming the URL with its password hidden, before the server was asked anything.
    assert_refused(runs[2], f"--url http://kvuser:***@127.0.0.1:{both.port} holds a user and password")
    assert asked_both == []


def test_a_key_given_where_a_variable_name_belongs_is_refused_unseen(tmp_path: Path) -> None:
    values = [KEY, "hf_AbCdEf0123456789xyz", "AKIAIOSFODNN7EXAMPLE"]
    folders = [tmp_path / str(index) for index in range(len(values))]
    for folder in folders:
        folder.mkdir()
    runs = run_together(
        *(
            (folder, ["--url", "http://127.0.0.1:9", "--api-key-env", value, *SMALL], None, CHECK_RUN_S)
            for folder, value in zip(folders, values, strict=True)
        )
    )
    for value, run in zip(values, runs, strict=True):
        assert run.code == 2 and "Traceback" not in run.stderr, run.stderr
        assert run.error_line.startswith("error: --api-key-env"), run.stderr
        assert "not shown: it may be" in run.error_line
        assert value not in run.stdout + run.stderr


def test_an_api_key_variable_name_is_shown_when_it_is_unset() -> None:
    with pytest.raises(UsageError, match="--api-key-env KVTUNE_NO_SUCH_KEY: the environment variable"):
        load_command.api_key("KVTUNE_NO_SUCH_KEY")


# ---- output paths that are not files -----------------------------------------------------------------------


def test_json_into_a_device_or_a_pipe_is_refused_before_the_run(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [Path("/dev/null"), fifo, tmp_path]
    folders = [tmp_path / str(index) for index in range(len(targets))]
    for folder in folders:
        folder.mkdir()
    runs = run_together(
        *(
            (folder, ["--url", "http://127.0.0.1:9", "--json", str(target), *SMALL], None, CHECK_RUN_S)
            for folder, target in zip(folders, targets, strict=True)
        )
    )
    for target, run in zip(targets, runs, strict=True):
        assert run.code == 2 and "Traceback" not in run.stderr, run.stderr
        assert run.error_line.startswith(f"error: --json {target}: is not a regular file"), run.stderr
    assert Path("/dev/null").is_char_device() and fifo.is_fifo()


def test_a_url_that_is_no_url_is_refused_without_its_password() -> None:
    with pytest.raises(UsageError) as refused:
        load_command.check_url(f"http://kvuser:{PASSWORD}@127.0.0.1:port")
    assert str(refused.value).startswith("--url ") and PASSWORD not in str(refused.value)
    with pytest.raises(
        UsageError, match=r"expected a base URL such as http://127.0.0.1:8000 \(http:// or https://, a host\)"
    ):
        load_command.check_url("127.0.0.1:8000")
