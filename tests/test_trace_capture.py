"""`kvtune up --capture-trace`: the router writes the traffic it serves as a trace without its text.

The router runs as it does in `kvtune up` (RouterServer in this process, RouterWorkers as processes) with a
real byte-level BPE tokenizer saved as a model folder (one token per byte, a chat template) in front of a
scripted upstream (a stand-in for vLLM: whole answers with and without usage, SSE streams split mid-event,
a failure). Captured files are read back with the strict trace reader.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune.cli import main as cli_main
from kvtune.engine import free_port
from kvtune.router import capture as capture_module
from kvtune.router import capture_files
from kvtune.router.capture import CapturePlan, CaptureSettings, TraceCapture
from kvtune.router.capture_files import RotatingFiles
from kvtune.router.prompt_tokens import PromptEncoder, prompt_tokens
from kvtune.router.proxy_settings import ProxySettings
from kvtune.router.server import RouterOptions, RouterServer, RouterTarget
from kvtune.router.workers import RouterWorkers
from kvtune.traces.format import MAX_HASH_ID, read_trace
from kvtune.traces.hashing import BlockHasher, new_key
from tests.fake_engine import HEALTHY_METRICS
from tests.helpers import default_profile_data

MODEL = "m"
BLOCK = 8
# Planted in prompts: it must reach no captured byte and no log line.
MARKER = "zebra-quartz-7f3a-private"
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
USAGE_TOKENS = 7  # a whole completion's usage
STREAM_USAGE_TOKENS = 9  # a stream's usage chunk, when the client asks for one
STREAM_TEXT_EVENTS = 5  # the stream's events that carry text


def save_tiny_tokenizer(folder: Path) -> Path:
    """A real byte-level BPE (each byte a token) with a chat template, saved as a model folder that
    transformers' AutoTokenizer loads (what the router and `kvtune trace convert` load)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: index for index, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    fast: Any = PreTrainedTokenizerFast
    fast(tokenizer_object=backend, chat_template=CHAT_TEMPLATE).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder)


def sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def stream_events(chat: bool, usage: bool) -> list[bytes]:
    """What vLLM streams: (chat) a role event, one event per token with text, a finish event with none,
    the usage chunk when asked, [DONE]."""

    def choice(text: str, finish: str | None = None) -> dict[str, Any]:
        part = {"delta": {"content": text}} if chat else {"text": text}
        return {"index": 0, **part, "finish_reason": finish}

    events = [sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})] if chat else []
    events += [sse({"choices": [choice(letter)]}) for letter in "abcde"[:STREAM_TEXT_EVENTS]]
    events.append(sse({"choices": [choice("", "stop")]}))
    if usage:
        events.append(sse({"choices": [], "usage": {"completion_tokens": STREAM_USAGE_TOKENS}}))
    return [*events, b"data: [DONE]\n\n"]


class ScriptedUpstream:
    """A stand-in for one vLLM server (fast tests only): /health, /metrics, and completions whole or
    streamed (each event written in two pieces, so the router reads events cut anywhere); a prompt that
    says "please fail" gets a 500."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                metrics = self.path == "/metrics"
                self._send(200, HEALTHY_METRICS.encode() if metrics else b"{}", "text/plain")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                chat = self.path == CHAT
                if "please fail" in json.dumps(body):
                    self._send(500, b'{"error": {"message": "failed"}}')
                elif body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    for event in stream_events(chat, usage):
                        half = len(event) // 2
                        for piece in (event[:half], event[half:]):
                            self.wfile.write(piece)
                            self.wfile.flush()
                            time.sleep(0.002)
                elif chat:  # no usage: the router counts the text
                    self._send(200, json.dumps({"choices": [{"message": {"content": "abcdef"}}]}).encode())
                else:
                    answer = {"choices": [{"text": "abc"}], "usage": {"completion_tokens": USAGE_TOKENS}}
                    self._send(200, json.dumps(answer).encode())

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[ScriptedUpstream]:
    server = ScriptedUpstream()
    yield server
    server.stop()


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def settings(folder: Path, max_file_bytes: int = 1 << 20, keep: int = 4) -> CaptureSettings:
    return CapturePlan(folder, max_file_bytes, keep).start()


def router_settings() -> ProxySettings:
    return ProxySettings(served_model_name=MODEL, block_size=BLOCK, max_model_len=4096)


class CapturingRouter:
    """The router inside `kvtune up` (RouterServer in this process) capturing into a folder."""

    def __init__(self, upstream: ScriptedUpstream, tokenizer: Any, capture: CaptureSettings) -> None:
        self.server = RouterServer(
            RouterOptions(policy="round_robin", port=free_port(), health_period_s=0.05),
            [RouterTarget("e0", upstream.url)],
            router_settings(),
            tokenizer_path="unused: the tokenizer is given",
            tokenizer=tokenizer,
            capture=capture,
        )
        self.server.start()
        eventually(lambda: self.server.engines[0].ready, "the router sees e0 ready")
        self.client = httpx.Client(base_url=self.server.url, timeout=60)

    def send(self, endpoint: str, **body: Any) -> httpx.Response:
        return self.client.post(endpoint, json={"model": MODEL, **body})

    def stop(self) -> None:
        self.client.close()
        self.server.stop()


def prompt_length(tokenizer: Any, endpoint: str, body: dict[str, Any]) -> int:
    return len(prompt_tokens(PromptEncoder(tokenizer), body, endpoint))


def captured_bytes(folder: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file())


# ---- through the router ---------------------------------------------------------------------------------


def test_what_the_router_serves_is_captured_in_arrival_order_and_nothing_else(
    tmp_path: Path, upstream: ScriptedUpstream, tokenizer: Any
) -> None:
    folder = tmp_path / "capture"
    folder.mkdir()
    router = CapturingRouter(upstream, tokenizer, settings(folder))
    chat: dict[str, Any] = {
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    }
    served: list[tuple[str, dict[str, Any], int]] = [
        (COMPLETION, {"prompt": "The capital of France is"}, USAGE_TOKENS),
        (CHAT, chat, len("abcdef")),  # no usage in the answer: counted with the tokenizer
        (COMPLETION, {"prompt": "Count to five:", "stream": True}, STREAM_TEXT_EVENTS),
        (CHAT, {**chat, "stream": True}, STREAM_TEXT_EVENTS),  # the role and finish events carry no text
        (CHAT, {**chat, "stream": True, "stream_options": {"include_usage": True}}, STREAM_USAGE_TOKENS),
    ]
    try:
        for number, (endpoint, body, _output) in enumerate(served):
            assert router.send(endpoint, **body).status_code == 200
            # Neither refused nor failed requests are in the trace.
            assert router.send(COMPLETION, prompt="x", model="not-served").status_code == 404
            assert router.send(endpoint, **(body | {"prompt": f"please fail {number}"})).status_code == 500
    finally:
        router.stop()
    (path,) = folder.iterdir()
    assert path.name == "capture-w0-000001.jsonl"
    trace = read_trace(path)
    assert trace.block_size == BLOCK
    assert [r.output_length for r in trace.requests] == [output for _e, _b, output in served]
    assert [r.input_length for r in trace.requests] == [
        prompt_length(tokenizer, endpoint, body) for endpoint, body, _output in served
    ]
    for request in trace.requests:
        assert len(request.hash_ids) == math.ceil(request.input_length / BLOCK)
    times = [r.timestamp_ms for r in trace.requests]
    assert times == sorted(times) and 0 < times[0] < 60_000, "milliseconds from the capture's start"
    assert json.loads(path.read_text().splitlines()[0])["block_size"] == BLOCK


def test_no_text_and_no_key_reach_a_file_or_the_log(
    tmp_path: Path, upstream: ScriptedUpstream, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "capture"
    folder.mkdir()
    capture = settings(folder)
    caplog.set_level(logging.DEBUG)
    router = CapturingRouter(upstream, tokenizer, capture)
    secret = f"My card is {MARKER}. "
    try:
        for stream in (False, True):
            assert router.send(COMPLETION, prompt=secret * 3, stream=stream).status_code == 200
            messages = [{"role": "user", "content": secret}]
            assert router.send(CHAT, messages=messages, stream=stream).status_code == 200
    finally:
        router.stop()
    data = captured_bytes(folder)
    assert len(read_trace(next(folder.iterdir())).requests) == 4
    for value in (MARKER.encode(), capture.key_hex.encode(), bytes.fromhex(capture.key_hex)):
        assert value not in data
    assert MARKER not in caplog.text and capture.key_hex not in caplog.text
    assert capture.key_hex not in repr(capture)


# ---- the ids ------------------------------------------------------------------------------------------


def test_equal_prefixes_get_equal_ids_and_nothing_else_does() -> None:
    key = new_key()
    hasher = BlockHasher(key, 4)
    shared = list(range(100, 108))  # two whole blocks
    first, second = hasher.ids([*shared, 1, 2, 3]), hasher.ids([*shared, 1, 2, 4])
    assert len(first) == 3 and len(second) == 3, "the partial last block has an id too"
    assert first[:2] == second[:2] and first[2] != second[2]
    assert hasher.ids([*shared, 1, 2, 3]) == first, "the same prompt, the same ids"
    # The same block after another prefix is another id: an id stands for its whole prefix.
    other = hasher.ids([7, 7, 7, 7, *shared[4:]])
    assert other[1] != first[1] and not set(other) & set(first)
    assert all(0 <= value <= MAX_HASH_ID for value in first + second + other)
    assert not set(BlockHasher(new_key(), 4).ids([*shared, 1, 2, 3])) & set(first), "another key, other ids"
    assert key.hex() not in repr(hasher)


def test_lines_wait_for_earlier_arrivals_and_a_request_open_too_long_is_left_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture_module, "MAX_HELD", 3)
    now = [0]
    capture = TraceCapture(settings(tmp_path), BLOCK, 0, len, clock=lambda: now[0])
    origin = capture._origin_ns
    tickets = []
    for step in range(7):
        now[0] = origin + step * 1_000_000  # one a millisecond
        tickets.append(capture.arrive())
    tokens = list(range(1, 20))
    tickets[2].finish(tokens, 2)  # ends before 0 and 1: held back
    tickets[1].drop()  # refused: nothing to write
    assert capture.writer.files._fd is None, "nothing written while request 0 is open"
    for ticket in tickets[3:6]:
        ticket.finish(tokens, 3)  # four ended behind the open request 0: it is given up
    assert capture.left_out == 1
    tickets[0].finish(tokens, 1)  # too late: left out
    tickets[6].finish(tokens, 6)
    capture.close()
    trace = read_trace(tmp_path / "capture-w0-000001.jsonl")
    assert [r.timestamp_ms for r in trace.requests] == [2, 3, 4, 5, 6]
    assert [r.output_length for r in trace.requests] == [2, 3, 3, 3, 6]


def test_files_rotate_at_their_size_the_oldest_go_and_a_restarted_worker_overwrites_none(
    tmp_path: Path,
) -> None:
    capture = settings(tmp_path, max_file_bytes=300, keep=3)

    def write(count: int) -> None:
        writer = TraceCapture(capture, BLOCK, 1, len)
        for _ in range(count):
            writer.arrive().finish(list(range(40)), 1)
        writer.close()

    write(30)
    write(2)  # the worker started again: its numbering goes on
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names == [f"capture-w1-{number:06d}.jsonl" for number in (30, 31, 32)], "one line a file"
    for path in tmp_path.iterdir():
        assert path.stat().st_size <= 300
        assert read_trace(path).requests, "each file is a trace of its own"


def test_a_full_disk_logs_once_stops_the_capture_and_fails_no_request(
    tmp_path: Path,
    upstream: ScriptedUpstream,
    tokenizer: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    writes = [0]

    def filling(fd: int, data: bytes) -> None:
        writes[0] += 1
        if writes[0] > 2:  # the third line finds the disk full, halfway
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        os.write(fd, data)

    monkeypatch.setattr(RotatingFiles, "_append", staticmethod(filling))
    folder = tmp_path / "capture"
    folder.mkdir()
    router = CapturingRouter(upstream, tokenizer, settings(folder))
    try:
        for number in range(6):
            assert router.send(COMPLETION, prompt=f"request {number}").status_code == 200
    finally:
        router.stop()
    stops = [r for r in caplog.records if "trace capture into" in r.getMessage()]
    assert len(stops) == 1 and "No space left on device" in stops[0].getMessage()
    assert len(read_trace(next(folder.iterdir())).requests) == 2, "cut back to its whole lines"


# ---- router workers ------------------------------------------------------------------------------------


def test_workers_share_one_key_and_one_clock_and_keep_the_key_off_argv_env_and_logs(
    tmp_path: Path, upstream: ScriptedUpstream, tokenizer_folder: Path, tokenizer: Any
) -> None:
    folder, logs = tmp_path / "capture", tmp_path / "logs"
    folder.mkdir()
    capture = settings(folder)
    options = RouterOptions(policy="round_robin", port=free_port(), health_period_s=0.1, workers=2,
                            worker_ports=(free_port(), free_port()))  # fmt: skip
    workers = RouterWorkers(
        options, [RouterTarget("e0", upstream.url)], router_settings(), str(tokenizer_folder), logs,
        capture=capture,
    )  # fmt: skip
    repeated = f"A shared system prompt, {MARKER}, long enough for a few blocks."
    sent = [f"{repeated} Question {'?' * number}" for number in range(24)]  # each its own length
    workers.start()
    try:
        assert workers.wait_seen_ready(["e0"]) == []
        for pid in [slot.proc.pid for slot in workers.slots if slot.proc is not None]:
            for view in ("cmdline", "environ"):
                assert capture.key_hex.encode() not in Path(f"/proc/{pid}/{view}").read_bytes()
        for prompt in sent:  # a new connection each: the kernel spreads them over both workers
            answer = httpx.post(
                f"{workers.url}{COMPLETION}", json={"model": MODEL, "prompt": prompt}, timeout=60
            )
            assert answer.status_code == 200
    finally:
        workers.stop()
    per_worker = {w: read_trace(path) for w, _n, path in capture_files.capture_files(folder)}
    assert sorted(per_worker) == [0, 1], "both workers served and wrote their own files"
    # One key: the shared prefix has the same ids whichever worker saw it.
    heads = {trace.requests[0].hash_ids[:4] for trace in per_worker.values()}
    assert len(heads) == 1
    merged = tmp_path / "merged.jsonl"
    assert cli_main(["trace", "merge", str(folder), "-o", str(merged)]) == 0
    # One clock: merged by time, the requests come back in the order they were sent.
    lengths = [prompt_length(tokenizer, COMPLETION, {"prompt": prompt}) for prompt in sent]
    assert [r.input_length for r in read_trace(merged).requests] == lengths
    for path in [*folder.iterdir(), *logs.iterdir(), merged]:
        data = path.read_bytes()
        assert MARKER.encode() not in data and capture.key_hex.encode() not in data, path


def test_merge_puts_two_workers_files_in_arrival_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capture = settings(tmp_path, max_file_bytes=200, keep=100)
    now = [capture.origin_ns]
    writers = [TraceCapture(capture, BLOCK, worker, len, clock=lambda: now[0]) for worker in (0, 1)]
    for step in range(12):
        now[0] = capture.origin_ns + step * 10_000_000
        writers[int(step % 3 == 0)].arrive().finish(list(range(step + 1)), step)
    for writer in writers:
        writer.close()
    assert len(list(tmp_path.iterdir())) > 2, "rotated files too"
    out = tmp_path / "out" / "trace.jsonl"
    out.parent.mkdir()
    assert cli_main(["trace", "merge", str(tmp_path), "-o", str(out)]) == 0
    trace = read_trace(out)
    assert [r.timestamp_ms for r in trace.requests] == [step * 10 for step in range(12)]
    assert [r.output_length for r in trace.requests] == list(range(12))
    assert "Merged 12 requests" in " ".join(capsys.readouterr().err.split())
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["trace", "merge", str(empty), "-o", str(out)]) == 2
    assert "holds no capture files" in " ".join(capsys.readouterr().err.split())


# ---- kvtune up refuses a capture that cannot run, before anything starts -------------------------------


def up_argv(tmp_path: Path, *extra: str, replicas: int = 1) -> list[str]:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(default_profile_data(name="cap", replicas=replicas)))
    return ["up", str(profile), "--log-dir", str(tmp_path / "logs"), "--control-port", str(free_port()),
            "--router-port", str(free_port()), *extra]  # fmt: skip


def test_up_refuses_a_capture_folder_it_cannot_write_before_anything_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = up_argv(tmp_path, "--router", "round_robin", "--capture-trace", str(blocker / "capture"))
    done = subprocess.run([sys.executable, "-m", "kvtune.cli", *argv], capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 2, output
    assert "--capture-trace" in output and "cannot write there" in output and "Traceback" not in output
    assert not (tmp_path / "logs").exists(), "nothing started, no log folder made"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--capture-trace", "{tmp}/c"], "the router captures the traffic, and no router runs here"),
        (["--capture-keep", "3"], "--capture-keep sets up a capture: add --capture-trace DIR"),
        (["--router", "round_robin", "--capture-trace", "{tmp}/old"], "holds an earlier capture's files"),
        (["--router", "round_robin", "--capture-trace", "{tmp}/c", "--capture-max-mib", "0"],
         "--capture-max-mib: 0 is out of range; give 0.01 to 16,384 MiB"),
    ],
)  # fmt: skip
def test_up_refuses_a_capture_that_cannot_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], expected: str
) -> None:
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "capture-w0-000001.jsonl").write_text("")
    argv = up_argv(tmp_path, *(word.format(tmp=tmp_path) for word in extra))
    try:
        code = cli_main(argv)
    except SystemExit as exited:  # argparse's own refusal
        code = int(exited.code or 0)
    assert code == 2
    assert expected in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "logs").exists()
