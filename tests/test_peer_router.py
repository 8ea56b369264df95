"""vllm-router (benchmarks/peer_router.py) in front of two stand-in engines: started, ready, routing by its
policies, stopped; a dead engine, an engine cache_aware cannot use, or a router that exits is a clear error.

The stand-ins answer what vllm-router asks of an engine (GET /health and /v1/models, POST
/v1/chat/completions/render or /tokenize for cache_aware's token ids, the streamed chat) and hold every chat
until the test releases them: each request is sent once the earlier ones are held at an engine, so every
routing decision is made with those still in flight, whatever the host's speed. The real engines are in
benchmarks/router.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from benchmarks.peer_router import (
    ENGINE_ARGS,
    PIN,
    prefix_outcomes,
    vllm_router,
    vllm_router_binary,
    vllm_router_version,
)
from kvtune.engine import free_port, port_in_use

HOST = "127.0.0.1"
MODEL = "stand-in"
LONG = "Answer as the ship's archivist, citing the log book by page and line. " * 30
WAIT_S = 30.0  # a bound for things that happen at once; reaching it fails the test


class StandInEngine:
    """An OpenAI chat server in a thread of its own; `render=False` answers render as vLLM does without
    --enable-scale-out (403)."""

    def __init__(self, render: bool = True) -> None:
        self.render = render
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.chats: list[str] = []  # the last message of every chat it was sent
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._release = asyncio.Event()
        self._runner = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(WAIT_S)

    async def _serve(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions/render", self._render)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/chat/completions", self._chat)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, HOST, self.port).start()
        return runner

    @staticmethod
    async def _tokens(request: web.Request) -> list[int]:
        body = await request.json()
        return list("".join(m["content"] for m in body["messages"]).encode())

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _render(self, request: web.Request) -> web.Response:
        if not self.render:
            error = {"message": "Scale-out endpoints are disabled.", "type": "PermissionDeniedError"}
            return web.json_response({"error": error | {"code": 403}}, status=403)
        return web.json_response({"request_id": "render", "token_ids": await self._tokens(request)})

    async def _tokenize(self, request: web.Request) -> web.Response:
        tokens = await self._tokens(request)
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.chats.append(body["messages"][-1]["content"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await self._release.wait()
        delta = {"index": 0, "delta": {"content": self.url}, "finish_reason": None}
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, "choices": [delta]}
        await response.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._release.set)

    def stop(self) -> None:
        self.release()
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(WAIT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(WAIT_S)
        self._loop.close()


@pytest.fixture
def engines() -> Iterator[list[StandInEngine]]:
    pair = [StandInEngine(), StandInEngine()]
    yield pair
    for engine in pair:
        engine.stop()


@pytest.fixture
def engines_without_render() -> Iterator[list[StandInEngine]]:
    pair = [StandInEngine(render=False), StandInEngine(render=False)]
    yield pair
    for engine in pair:
        engine.stop()


def send_held(front: str, prompts: list[str], engines: list[StandInEngine]) -> list[str]:
    """Each prompt as a streamed chat, sent once the earlier ones are all held at an engine; then all are
    released. The answers (each names the engine that served it), in the order sent."""

    async def chat(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True}
        answer: list[str] = []
        async with client.stream("POST", f"{front}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    answer.append(json.loads(line[6:])["choices"][0]["delta"]["content"])
        return "".join(answer)

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            sent: list[asyncio.Task[str]] = []
            for count, prompt in enumerate(prompts, start=1):
                sent.append(asyncio.create_task(chat(client, prompt)))
                deadline = time.monotonic() + WAIT_S
                while sum(len(e.chats) for e in engines) < count:
                    assert time.monotonic() < deadline, f"request {count} never reached an engine"
                    await asyncio.sleep(0.02)
            for engine in engines:
                engine.release()
            return list(await asyncio.gather(*sent))

    return asyncio.run(run())


def served(engines: list[StandInEngine]) -> list[int]:
    return [len(e.chats) for e in engines]


def test_the_installed_router_is_the_pinned_one() -> None:
    assert vllm_router_binary().is_file()
    assert f"vllm-router=={vllm_router_version()}" == PIN


def test_a_missing_router_names_the_pin(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=f"vllm-router is not installed.*{PIN}"):
        vllm_router_binary(tmp_path)


def test_round_robin_takes_the_engines_in_turn(engines: list[StandInEngine], tmp_path: Path) -> None:
    port = free_port()
    urls = [e.url for e in engines]
    with vllm_router("round_robin", urls, port, tmp_path / "router.log", MODEL) as front:
        assert front == f"http://{HOST}:{port}"
        answers = send_held(front, [f"{i}: {LONG}" for i in range(4)], engines)
    assert served(engines) == [2, 2]
    assert answers[0] != answers[1] and answers[0::2] == [answers[0]] * 2  # in turn, through the router
    assert set(answers) == set(urls)
    assert not port_in_use(HOST, port)  # stopped


def test_cache_aware_keeps_a_shared_prefix_together(engines: list[StandInEngine], tmp_path: Path) -> None:
    port, metrics_port = free_port(), free_port()
    urls = [e.url for e in engines]
    with vllm_router(
        "cache_aware", urls, port, tmp_path / "router.log", MODEL, metrics_port=metrics_port
    ) as front:
        answers = send_held(front, [f"{LONG} Question {i}?" for i in range(4)], engines)
        outcomes = prefix_outcomes(metrics_port)
    assert sorted(served(engines)) == [0, 4]
    assert len(set(answers)) == 1
    assert outcomes.get("prefix_hit") == 3
    assert not port_in_use(HOST, port) and not port_in_use(HOST, metrics_port)


def test_cache_aware_spreads_unshared_prompts_by_load(engines: list[StandInEngine], tmp_path: Path) -> None:
    """The same text after a different first word shares no prefix: each goes to the engine with fewer
    requests in flight (so the test above is the shared prefix at work, not a tie broken one way)."""
    urls = [e.url for e in engines]
    with vllm_router("cache_aware", urls, free_port(), tmp_path / "router.log", MODEL) as front:
        send_held(front, [f"{i}: {LONG}" for i in range(4)], engines)
    assert served(engines) == [2, 2]


def test_cache_aware_refuses_engines_without_render(
    engines_without_render: list[StandInEngine], tmp_path: Path
) -> None:
    """vLLM without --enable-scale-out: vllm-router gets no token ids and routes by load alone."""
    engines = engines_without_render
    urls = [e.url for e in engines]
    refused = pytest.raises(RuntimeError, match=f"answered 403.*{ENGINE_ARGS[0]}")
    with refused, vllm_router("cache_aware", urls, free_port(), tmp_path / "router.log", MODEL):
        pytest.fail("started in front of engines without render")
    assert not (tmp_path / "router.log").exists()  # refused before starting anything

    metrics_port = free_port()
    with vllm_router(
        "cache_aware", urls, free_port(), tmp_path / "router.log", MODEL, metrics_port=metrics_port,
        require_render=False,
    ) as front:  # fmt: skip
        send_held(front, [f"{LONG} Question {i}?" for i in range(4)], engines)
        outcomes = prefix_outcomes(metrics_port)
    assert served(engines) == [2, 2]  # the shared prompt spread: no affinity
    assert outcomes == {"missing_tokens": 4}


def test_a_dead_engine_is_a_clear_error(engines: list[StandInEngine], tmp_path: Path) -> None:
    """vllm-router itself would start, with one engine of two serving, and report both healthy."""
    dead = f"http://{HOST}:{free_port()}"
    log = tmp_path / "router.log"
    failed = pytest.raises(RuntimeError, match=f"{dead}: GET /health failed")
    with failed, vllm_router("round_robin", [engines[0].url, dead], free_port(), log, MODEL):
        pytest.fail("ready in front of a dead engine")
    assert not log.exists()  # refused before starting anything


def test_a_router_that_exits_is_a_clear_error(engines: list[StandInEngine], tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        urls = [e.url for e in engines]
        exited = pytest.raises(RuntimeError, match="exited with code 1 before it was ready")
        with exited as raised, vllm_router("round_robin", urls, port, tmp_path / "router.log", MODEL):
            pytest.fail("ready on a port another server holds")
    assert "Address already in use" in str(raised.value)


def test_a_router_never_ready_is_a_clear_error(engines: list[StandInEngine], tmp_path: Path) -> None:
    """Engines serving another model than the one asked for: the router runs, but is not what was meant.
    (The deadline leaves the router ample time to listen, so the reason is the model, on a busy host too.)"""
    port = free_port()
    urls = [e.url for e in engines]
    late = pytest.raises(RuntimeError, match=r"not ready after 20 s \(GET /v1/models .*not 'other'\)")
    with late, vllm_router("round_robin", urls, port, tmp_path / "router.log", "other", ready_timeout_s=20):
        pytest.fail("ready for a model no engine serves")
    assert not port_in_use(HOST, port)
