"""The trace workload through real Locust, against a stand-in OpenAI server: `kvtune load`, headless Locust
and Locust's web UI each replay the trace once, at its own times or in its order, and stop at its end.

The stand-in (tests/hostile_servers.py) answers every completion with as many tokens as max_tokens asks,
a configurable pause between them, and records every request; its model list names a tiny word-level
tokenizer and a max_model_len, its /metrics vLLM's cache_config_info (block size 16). No engine: what these
tests check is what the client sends and when, which a real engine's speed would only blur. A real engine
replays a trace in tests/test_trace_load_real.py.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune.engine import free_port
from kvtune.loadgen.text import _WORDS
from kvtune.loadgen.trace_workload import EngineFacts, TraceArgs, TraceWorkload, build_trace_workload
from kvtune.loadgen.workload_args import API_KEY_ENV
from kvtune.loadgen.workloads import Conversation
from kvtune.processes import stop_group
from kvtune.traces.format import write_trace
from kvtune.traces.synthetic import ChatTraceShape, chat_trace
from tests.helpers import REPO
from tests.hostile_servers import POOL_LABELS, Exchange, HostileServer, json_reply, vllm_metrics

LOCUST = Path(sys.executable).with_name("locust")
MODEL = "tiny"
BLOCK = int(POOL_LABELS["block_size"])  # the stand-in engine's block size (16)
# Small conversations in trace blocks of 32 tokens: 16-token engine blocks halve every length.
SHAPE = ChatTraceShape(conversations=6, system_prompts=2, system_tokens=64, turns=2, user_tokens=32,
                       output_tokens=16, block_size=32, conversation_rate=4.0, think_s=0.5,
                       seed=3)  # fmt: skip
RUN_S = 120.0  # a generous bound on one run: Python, Locust and a few seconds of trace


@pytest.fixture(scope="module")
def tokenizer_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A word-level tokenizer.json with 2,000+ ids: a vocabulary that holds the trace's token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, ".": 1} | {f"w{i}": i + 2 for i in range(2000)}
    for word in _WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


def event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def answering(token_s: float) -> Any:
    """Stream max_tokens tokens, `token_s` apart, as vLLM does with ignore_eos; usage counts them."""

    def route(exchange: Exchange) -> None:
        body = json.loads(exchange.request.body)
        tokens = int(body["max_tokens"])
        exchange.start(200, {"Content-Type": "text/event-stream"})
        for index in range(tokens):
            chunk = {"choices": [{"index": 0, "text": f"t{index} ", "delta": {"content": f"t{index} "}}]}
            if not (exchange.write(event(chunk)) and exchange.pause(token_s)):
                return
        prompt = body.get("prompt")
        usage = {"prompt_tokens": len(prompt) if isinstance(prompt, list) else 8, "completion_tokens": tokens}
        exchange.write(event({"choices": [], "usage": usage}))
        exchange.write(b"data: [DONE]\n\n")
        exchange.finish()

    return route


@dataclass
class Fake:
    server: HostileServer
    max_model_len: int

    @property
    def url(self) -> str:
        return self.server.url

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.body) for r in self.server.requests if r.method == "POST"]


def fake_engine(tokenizer_root: str, max_model_len: int = 4096, token_s: float = 0.005) -> Fake:
    server = HostileServer()
    listed = {"id": MODEL, "root": tokenizer_root, "max_model_len": max_model_len}
    server.route("/v1/models", json_reply({"object": "list", "data": [listed]}))
    server.route("/metrics", vllm_metrics())
    server.route("/v1/completions", answering(token_s))
    server.route("/v1/chat/completions", answering(token_s))
    return Fake(server.start(), max_model_len)


@pytest.fixture
def fake(tokenizer_root: str) -> Iterator[Fake]:
    engine = fake_engine(tokenizer_root)
    yield engine
    engine.server.stop()


def chat_file(folder: Path) -> Path:
    path = folder / "chat.jsonl"
    with path.open("w") as file:
        write_trace(file, chat_trace(SHAPE), SHAPE.block_size)
    return path


def planned(path: Path, fake: Fake, vocab: int, **flags: str | int | float) -> TraceWorkload:
    """The requests the run should send, built as the Locust process builds them."""
    engine = EngineFacts(BLOCK, fake.max_model_len, vocab)
    return build_trace_workload(TraceArgs.of({"trace-file": str(path), **flags}), engine, "trace", 64)


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str
    seconds: float
    result: dict[str, Any]
    samples: list[dict[str, Any]]


def kvtune_load(folder: Path, url: str, *argv: str) -> Run:
    """`kvtune load` as a user runs it, its result and its samples kept in FOLDER."""
    kept = folder / "kept"
    kept.mkdir()
    out = folder / "result.json"
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvtune.cli", "load", "--url", url, "--json", str(out),
                           "--keep-samples", str(kept), *argv], capture_output=True, text=True, env=env,
                          timeout=RUN_S, check=False)  # fmt: skip
    seconds = time.monotonic() - began
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.stdout, done.stderr)
    records = [
        json.loads(line) for path in kept.rglob("samples.*.jsonl") for line in path.read_text().splitlines()
    ]
    return Run(done.returncode, done.stdout, done.stderr, seconds, json.loads(out.read_text()),
               sorted(records, key=lambda r: r["sent"]))  # fmt: skip


def test_kvtune_load_sends_a_trace_at_its_own_times_as_token_ids_and_ends_with_it(
    tokenizer_root: str, tmp_path: Path
) -> None:
    path = chat_file(tmp_path)
    fake = fake_engine(tokenizer_root, max_model_len=64)  # second turns (72 + 8 tokens) are cut
    try:
        run = kvtune_load(tmp_path, fake.url, "--workload", "trace", "--arg", f"trace-file={path}",
                          "--arg", "time-scale=0.5", "--users", "16")  # fmt: skip
        bodies = fake.bodies()
    finally:
        fake.server.stop()
    plan = planned(path, fake, 2002 + len(set(_WORDS)), **{"time-scale": 0.5})
    expected = [plan.next_request(i, Conversation()) for i in range(len(plan))]
    # Every request once, as token ids, at the trace's output length (cut to max_model_len), never an EOS.
    assert len(bodies) == len(expected) == len(run.samples) == run.result["requests"]
    assert all(isinstance(b["prompt"], list) and b["ignore_eos"] is True for b in bodies)
    assert sorted((b["prompt"], b["max_tokens"]) for b in bodies) == sorted(
        (r.prompt_token_ids, r.max_tokens) for r in expected
    )
    assert all(len(b["prompt"]) + b["max_tokens"] <= 64 for b in bodies)
    # Each at the trace's own time from the run's start, never before it.
    assert sorted(r["trace_index"] for r in run.samples) == [r.trace_index for r in expected]
    start = min(r["intended"] for r in run.samples)
    by_index = {r["trace_index"]: r for r in run.samples}
    for position, request in enumerate(expected):
        sample = by_index[request.trace_index]
        assert sample["intended"] - start == pytest.approx(plan.arrivals[position], abs=1e-6)
        assert sample["sent"] >= sample["intended"]
        assert sample["designed_prompt_tokens"] == request.prompt_tokens
    # The run ends with the trace's last answer: the window is the trace, not a fixed duration.
    last = max(r["sent"] + r["e2e"] - (r["sent"] - r["intended"]) for r in run.samples)
    assert run.result["window_s"] <= last - start + 0.1
    assert run.result["window_s"] >= plan.arrivals[-1]
    lateness = run.result["lateness"]
    assert lateness["count"] == len(expected)
    assert lateness["max_s"] == pytest.approx(max(r["sent"] - r["intended"] for r in run.samples), abs=1e-3)
    assert lateness["late"] == sum(r["sent"] - r["intended"] > lateness["tolerance_s"] for r in run.samples)
    assert plan.cuts.requests > 0
    assert run.result["trace_cuts"] == {
        "requests": plan.cuts.requests,
        "prompt_tokens": plan.cuts.prompt_tokens,
        "output_tokens": plan.cuts.output_tokens,
    }
    shown = " ".join((run.stdout + run.stderr).split())
    assert f"sent late: {lateness['late']} of {len(expected)} beyond 50 ms" in shown
    assert f"{plan.cuts.requests} trace requests were cut to fit the engine's max_model_len" in shown
    assert "trace, its own arrival times" in shown


def test_a_closed_loop_of_one_user_replays_the_trace_in_order_one_request_at_a_time(
    fake: Fake, tmp_path: Path
) -> None:
    path = chat_file(tmp_path)
    run = kvtune_load(tmp_path, fake.url, "--workload", "trace", "--arg", f"trace-file={path}",
                      "--arrival", "closed", "--users", "1")  # fmt: skip
    assert [r["trace_index"] for r in run.samples] == list(range(len(chat_trace(SHAPE))))
    for earlier, later in itertools.pairwise(run.samples):
        assert later["sent"] >= earlier["intended"] + earlier["e2e"] - 0.002  # after the answer before
    assert run.result["arrival"] == "closed" and run.result["lateness"] is None


def test_a_trace_faster_than_the_server_is_sent_late_and_timed_from_its_own_times(
    tokenizer_root: str, tmp_path: Path
) -> None:
    path = chat_file(tmp_path)
    fake = fake_engine(tokenizer_root, token_s=0.02)
    try:
        # All twelve requests due within milliseconds, one user: each waits for the answer before it.
        run = kvtune_load(tmp_path, fake.url, "--workload", "trace", "--arg", f"trace-file={path}",
                          "--arg", "time-scale=0.001", "--users", "1")  # fmt: skip
    finally:
        fake.server.stop()
    late = [r["sent"] - r["intended"] for r in run.samples]
    assert all(b > a for a, b in itertools.pairwise(late)), late  # the queue grows
    assert all(r["e2e"] >= r["sent"] - r["intended"] for r in run.samples)  # the wait is in the latency
    assert all(r["ttft"] >= r["sent"] - r["intended"] for r in run.samples)
    lateness = run.result["lateness"]
    assert lateness["late"] >= len(run.samples) - 2 and run.result["unsent"] == 0
    assert run.result["e2e"]["p99"] >= lateness["p99_s"]


def test_a_text_trace_keeps_its_messages_and_timestamps(fake: Fake, tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"timestamp": 300, "prompt": "The three primary colours are", "max_tokens": 3},
        {"timestamp": 900, "messages": [{"role": "user", "content": "And of Spain?"}]},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = kvtune_load(tmp_path, fake.url, "--workload", "trace", "--arg", f"trace-file={path}",
                      "--max-tokens", "4")  # fmt: skip
    start = run.samples[0]["intended"]
    assert [round(r["intended"] - start, 6) for r in run.samples] == [0.0, 0.3, 0.9]
    paths = [r.path for r in fake.server.requests if r.method == "POST"]
    assert paths == ["/v1/chat/completions", "/v1/completions", "/v1/chat/completions"]
    assert [b.get("messages") or b.get("prompt") for b in fake.bodies()] == [
        lines[0]["messages"], lines[1]["prompt"], lines[2]["messages"],
    ]  # fmt: skip
    assert [b["max_tokens"] for b in fake.bodies()] == [4, 3, 4]
    assert run.result["requests"] == 3 and run.result["trace_cuts"]["requests"] == 0


def locust_argv(url: str, path: Path, *extra: str) -> list[str]:
    return [str(LOCUST), "-f", str(REPO / "loadtests" / "trace.py"), "--host", url, "--trace-file", str(path),
            "--time-scale", "0.3", *extra]  # fmt: skip


def test_headless_locust_quits_at_the_traces_end(fake: Fake, tmp_path: Path) -> None:
    path = chat_file(tmp_path)
    done = subprocess.run(locust_argv(fake.url, path, "--headless", "-u", "3", "-r", "3", "--only-summary"),
                          capture_output=True, text=True, timeout=RUN_S, check=False, cwd=REPO)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(fake.bodies()) == len(chat_trace(SHAPE))
    assert "the test ends" in done.stderr


def swarm_state(web: str) -> tuple[str, int]:
    stats = httpx.get(f"{web}/stats/requests", timeout=5).json()
    total = next(row["num_requests"] for row in stats["stats"] if row["name"] == "Aggregated")
    return stats["state"], total


def test_the_web_ui_test_stops_at_the_traces_end_and_a_new_one_replays_it(fake: Fake, tmp_path: Path) -> None:
    path = chat_file(tmp_path)
    port = free_port()
    web = f"http://127.0.0.1:{port}"
    log = (tmp_path / "locust.log").open("w")
    argv = locust_argv(fake.url, path, "--web-host", "127.0.0.1", "--web-port", str(port))
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    requests = len(chat_trace(SHAPE))
    try:
        deadline = time.monotonic() + RUN_S
        while True:
            assert process.poll() is None, (tmp_path / "locust.log").read_text()
            try:
                httpx.get(web, timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, (tmp_path / "locust.log").read_text()
                time.sleep(0.3)
        for run in (1, 2):
            answer = httpx.post(f"{web}/swarm", data={"user_count": 3, "spawn_rate": 3, "host": fake.url})
            assert answer.json()["success"], answer.text
            while (state := swarm_state(web))[0] != "stopped" or len(fake.bodies()) < run * requests:
                assert time.monotonic() < deadline, (state, (tmp_path / "locust.log").read_text())
                time.sleep(0.3)
            # The test stopped by itself with every request of the trace answered, once (run 2 anew).
            time.sleep(1.0)  # nothing more comes
            assert swarm_state(web) == ("stopped", requests) and len(fake.bodies()) == run * requests
    finally:
        stop_group(process, grace_s=15.0)
        log.close()
