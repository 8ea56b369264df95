"""The router's HTTP surface with scripted upstreams (small local servers): refusals that forward nothing,
failover, decisions counted by reason, streams passed through unchanged. Real engines: test_router_real.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from kvtune.engine import free_port
from kvtune.loadgen.locust_discovery import _served_models
from kvtune.router.policies import EngineState, PolicyName, make_policy
from kvtune.router.proxy import ProxySettings, create_app

MODEL = "smollm2-135m"
STREAM = [
    b'data: {"choices": [{"text": "Par"}]}\n\n',
    b'data: {"choices": [{"text": "is"}]}\n\n',
    b"data: [DONE]\n\n",
]


def words(body: dict[str, Any], endpoint: str) -> list[int]:
    """A stand-in tokenizer: one token per character of the prompt or the messages' contents."""
    text = (
        body["prompt"] if endpoint == "/v1/completions" else "".join(m["content"] for m in body["messages"])
    )
    if not isinstance(text, str):
        raise TypeError("prompt must be a string")
    return [ord(c) for c in text]


class Upstreams:
    """Engines e0 and e1 as two small local HTTP servers (a scripted vLLM: fast unit tests only), recording
    what reaches them; an engine in `down` points at a port nothing listens on, so connections are refused."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.down: set[str] = set()
        self.servers = {name: self._serve(name) for name in ("e0", "e1")}
        self.closed_port = free_port()
        self.cleanups: list[Callable[[], object]] = []

    def _serve(self, name: str) -> tuple[uvicorn.Server, int]:
        app = FastAPI()

        @app.post("/v1/{endpoint:path}")
        async def answer(endpoint: str, request: Request) -> Response:
            body = json.loads(await request.body())
            self.calls.append((name, body))
            if body.get("stream"):

                async def events() -> AsyncIterator[bytes]:
                    for chunk in STREAM:
                        yield chunk

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"text": f"from {name}"}], "usage": {"prompt_tokens": 3}})

        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.01)
        return server, port

    def url(self, name: str) -> str:
        port = self.closed_port if name in self.down else self.servers[name][1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for cleanup in self.cleanups:
            cleanup()
        for server, _port in self.servers.values():
            server.should_exit = True


@pytest.fixture
def upstreams() -> Iterator[Upstreams]:
    fakes = Upstreams()
    yield fakes
    fakes.stop()


def router(
    upstreams: Upstreams, policy: PolicyName = "prefix", **settings: Any
) -> tuple[TestClient, list[EngineState], CollectorRegistry]:
    engines = [
        EngineState(name=n, url=upstreams.url(n), capacity_blocks=100, ready=True) for n in ("e0", "e1")
    ]
    registry = CollectorRegistry()
    app = create_app(ProxySettings(served_model_name=MODEL, block_size=4, **settings), engines,
                     make_policy(policy), words, registry=registry)  # fmt: skip
    client = TestClient(app)
    client.__enter__()  # one event loop for the whole test, as under uvicorn
    upstreams.cleanups.append(lambda: client.__exit__(None, None, None))
    return client, engines, registry


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("content", "headers", "status", "reason"),
    [
        (b"{not json", {}, 400, "not_json"),
        (b"[1, 2]", {}, 400, "not_json"),
        (json.dumps({"model": "gpt-4", "prompt": "hi"}).encode(), {}, 404, "unknown_model"),
        (json.dumps({"model": MODEL, "prompt": "x" * 64}).encode(), {}, 400, "too_long"),
        (json.dumps({"model": MODEL, "prompt": ["a", 1]}).encode(), {}, 400, "bad_prompt"),
        (
            json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
            {"Authorization": "Bearer wrong"},
            401,
            "api_key",
        ),
    ],
)
def test_bad_input_gets_an_openai_error_and_nothing_is_forwarded(
    content: bytes, headers: dict[str, str], status: int, reason: str, upstreams: Upstreams
) -> None:
    client, _engines, registry = router(upstreams, max_model_len=32, api_key="secret")
    headers = {"Authorization": "Bearer secret"} | headers
    response = client.post("/v1/completions", content=content, headers=headers)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert upstreams.calls == [], "a refused request never reaches an engine"
    assert metric(registry, "kvtune_router_refused_requests_total", reason=reason) == 1


def test_a_shared_prefix_goes_back_to_the_engine_that_has_it_and_the_reason_is_counted(
    upstreams: Upstreams,
) -> None:
    client, _engines, registry = router(upstreams)
    system = "You are a terse assistant. Answer in one word. " * 2
    first = client.post("/v1/completions", json={"model": MODEL, "prompt": system + "Capital of France?"})
    second = client.post("/v1/completions", json={"model": MODEL, "prompt": system + "Capital of Peru?"})
    assert first.status_code == second.status_code == 200
    assert upstreams.calls[0][0] == upstreams.calls[1][0]
    engine = upstreams.calls[0][0]
    assert (
        metric(
            registry, "kvtune_router_requests_total", engine=engine, policy="prefix", reason="prefix_match"
        )
        == 1
    )
    assert second.json()["choices"][0]["text"] == f"from {engine}"


def test_a_stream_passes_through_chunk_by_chunk(upstreams: Upstreams) -> None:
    client, engines, _registry = router(upstreams, policy="round_robin")
    chat = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with client.stream("POST", "/v1/chat/completions", json=chat) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert b"".join(response.iter_raw()) == b"".join(STREAM)
    assert all(engine.in_flight == 0 for engine in engines), "the stream's slot is given back"


def test_an_engine_that_refuses_connections_is_skipped_and_marked_unready(upstreams: Upstreams) -> None:
    upstreams.down.add("e0")
    client, engines, registry = router(upstreams, policy="round_robin")
    for _ in range(3):
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "hello"}).status_code == 200
    assert {host for host, _ in upstreams.calls} == {"e1"}
    assert engines[0].ready is False
    assert metric(registry, "kvtune_router_upstream_errors_total", engine="e0", kind="connect") == 1
    upstreams.down.add("e1")
    engines[1].url = upstreams.url("e1")
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello"})
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
    assert client.get("/health").status_code == 503


def test_session_routing_uses_the_header_or_the_user_field(upstreams: Upstreams) -> None:
    client, _engines, _registry = router(upstreams, policy="session")
    for turn in range(4):
        client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": f"turn {turn}"},
            headers={"x-session-id": "s-1"},
        )
        client.post("/v1/completions", json={"model": MODEL, "prompt": f"turn {turn}", "user": "u-7"})
    by_session = [host for host, _ in upstreams.calls]
    assert len(set(by_session[0::2])) == 1 and len(set(by_session[1::2])) == 1


@pytest.mark.parametrize(("root", "shown"), [("/models/smollm2-135m", "/models/smollm2-135m"), (None, MODEL)])
def test_the_model_list_names_the_model_root_a_tokenising_client_loads(
    upstreams: Upstreams, root: str | None, shown: str
) -> None:
    """A Locust workload finds its tokenizer from the list's `root`, as through an engine (the name alone
    would send it to the Hub)."""
    client, _engines, _registry = router(upstreams, model_root=root)
    answer = client.get("/v1/models")
    assert answer.status_code == 200
    (card,) = answer.json()["data"]
    assert card["id"] == MODEL and card["root"] == shown
    # As a client over the network reads it (the test client's answer is another httpx's type).
    served = _served_models(httpx.Response(200, content=answer.content, headers=dict(answer.headers)))
    assert served is not None and served[MODEL].root == shown
