"""The router's OpenAI API: check the request, pick an engine by the policy, pass the answer through.

Nothing is forwarded that the router can refuse itself (a missing or wrong API key, a body larger than
any prompt the engines take, a body that is not a JSON object, an unknown model, a prompt longer than the
engines' context): each gets an OpenAI-style error. Streams are passed through chunk by chunk; when the
client goes away the upstream response is closed, which makes vLLM abort the request. Upstream calls are
bounded as upstream.py says, and an engine that refuses the connection is marked unready and the request
tried once on another.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtune.router.policies import EngineState, NoEngineReady, Policy, RoutedRequest
from kvtune.router.prefix_index import block_hashes
from kvtune.router.prompt_tokens import PromptTooLong
from kvtune.router.request_limits import BodyTooLarge, default_max_body_bytes, read_body
from kvtune.router.router_metrics import RouterMetrics
from kvtune.router.upstream import AnswerTooLarge, Upstream, read_capped

# (body, endpoint) -> prompt token ids; ValueError, TypeError or KeyError for a prompt that cannot be
# read, PromptTooLong for one refused before tokenising.
Tokenize = Callable[[dict[str, Any], str], list[int]]


@dataclass(frozen=True)
class ProxySettings:
    served_model_name: str
    block_size: int
    max_model_len: int | None = None
    api_key: str | None = None  # what clients must send to the router
    engine_api_key: str | None = None  # what the router sends the engines
    session_header: str = "x-session-id"
    connect_timeout_s: float = 2.0
    # A streamed answer: the longest silence between two reads (a long generation is legitimate).
    read_timeout_s: float = 300.0
    # A non-streamed answer, sent to its last byte: vLLM sends it whole once the generation is done.
    answer_deadline_s: float = 300.0
    max_answer_bytes: int = 256 << 20
    # The largest request body read; None: sized from max_model_len (request_limits.py).
    max_body_bytes: int | None = None


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code or kind}}, status_code=status
    )


class Refused(Exception):
    """A request the router answers itself, with an OpenAI-style error; REASON labels the metric."""

    def __init__(
        self,
        reason: str,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.response = openai_error(status, message, kind, code)


def create_app(
    settings: ProxySettings,
    engines: Sequence[EngineState],
    policy: Policy,
    tokenize: Tokenize,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    registry = registry or CollectorRegistry()
    metrics = RouterMetrics(registry)
    max_body = settings.max_body_bytes or default_max_body_bytes(settings.max_model_len, None)
    upstream = Upstream(settings.connect_timeout_s, settings.read_timeout_s)
    app = FastAPI(title="kvtune router", docs_url=None, redoc_url=None)
    app.state.engines, app.state.metrics, app.state.upstream = engines, metrics, upstream
    app.router.add_event_handler("shutdown", upstream.close)

    def check_key(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
            raise Refused(
                "api_key", 401, "Invalid or missing API key", "authentication_error", "invalid_api_key"
            )

    async def parse(request: Request, endpoint: str) -> tuple[bytes, dict[str, Any], list[int]]:
        check_key(request)
        try:
            raw = await read_body(request, max_body)
        except BodyTooLarge as exc:
            raise Refused("too_large", 413, str(exc), code="request_too_large") from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise Refused("not_json", 400, f"the request body is not JSON: {exc}") from None
        except RecursionError:
            raise Refused("not_json", 400, "the request body is JSON nested too deep to read") from None
        if not isinstance(body, dict):
            raise Refused("not_json", 400, "the request body must be a JSON object")
        model = body.get("model")
        if model != settings.served_model_name:
            message = f"The model `{model}` does not exist; this router serves `{settings.served_model_name}`"
            raise Refused("unknown_model", 404, message, "NotFoundError", "model_not_found")
        try:
            tokens = tokenize(body, endpoint)
        except PromptTooLong as exc:
            raise Refused("too_long", 400, str(exc), code="context_length_exceeded") from None
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise Refused("bad_prompt", 400, f"the prompt cannot be read: {exc}") from None
        limit = settings.max_model_len
        if limit is not None and len(tokens) >= limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(tokens)} tokens."
            )
            raise Refused("too_long", 400, message, code="context_length_exceeded")
        return raw, body, tokens

    def session_of(request: Request, body: dict[str, Any]) -> str | None:
        value = request.headers.get(settings.session_header) or body.get("user")
        return str(value) if value else None

    async def forward(request: Request, endpoint: str) -> Response:
        arrived = time.perf_counter()
        try:
            raw, body, tokens = await parse(request, endpoint)
        except Refused as refused:
            metrics.refused.labels(refused.reason).inc()
            return refused.response
        routed = RoutedRequest(
            blocks=block_hashes(tokens, settings.block_size), session=session_of(request, body)
        )
        streamed = bool(body.get("stream"))
        # A streamed answer is bounded per read only; a whole one from sending it to its last byte.
        deadline = None if streamed else asyncio.get_running_loop().time() + settings.answer_deadline_s
        tried: set[str] = set()
        for _attempt in range(2):
            candidates = [engine for engine in engines if engine.name not in tried]
            try:
                decision = policy.choose(routed, candidates)
            except NoEngineReady as exc:
                return openai_error(503, f"no engine can take the request: {exc}", "service_unavailable")
            engine = decision.engine
            tried.add(engine.name)
            headers = {"Content-Type": "application/json"}
            if settings.engine_api_key:
                headers["Authorization"] = f"Bearer {settings.engine_api_key}"
            metrics.overhead.observe(time.perf_counter() - arrived)
            engine.in_flight += 1
            try:
                # The client's own bytes go upstream: nothing is re-encoded on the hot path.
                async with asyncio.timeout_at(deadline):
                    response = await upstream.post(engine.url + endpoint, raw, headers)
            except aiohttp.ClientConnectorError:
                engine.in_flight -= 1
                engine.ready = False  # the health loop brings it back when it answers again
                metrics.upstream_errors.labels(engine.name, "connect").inc()
                continue
            except TimeoutError:
                engine.in_flight -= 1
                metrics.upstream_errors.labels(engine.name, "timeout").inc()
                return openai_error(504, f"engine {engine.name} did not answer in time", "timeout")
            except aiohttp.ClientError as exc:
                engine.in_flight -= 1
                metrics.upstream_errors.labels(engine.name, "transport").inc()
                return openai_error(502, f"engine {engine.name} failed: {exc}", "upstream_error")
            engine.routed += 1
            metrics.requests.labels(engine.name, policy.name, decision.reason).inc()
            metrics.matched_blocks.observe(decision.matched_blocks)
            if response.status < 400:
                engine.took(routed.blocks)
            if streamed:
                return passthrough(response, engine)
            return await whole(response, engine, deadline)
        return openai_error(503, "every engine tried refused the connection", "service_unavailable")

    async def whole(
        response: aiohttp.ClientResponse, engine: EngineState, deadline: float | None
    ) -> Response:
        """A non-streamed answer read in full first (within the deadline and the size cap), so an engine
        dying, stalling or babbling mid-answer is a clean error."""
        failure: tuple[str, int, str] | None = None
        try:
            async with asyncio.timeout_at(deadline):
                content = await read_capped(response, settings.max_answer_bytes)
        except AnswerTooLarge as exc:
            failure = ("too_large", 502, f"engine {engine.name} answered too much: {exc}")
        except TimeoutError:
            failure = ("timeout", 504, f"engine {engine.name} did not finish its answer in time")
        except aiohttp.ClientError as exc:
            failure = ("broken_answer", 502, f"engine {engine.name} failed mid-answer: {exc}")
        finally:
            engine.in_flight -= 1
        if failure is not None:
            kind, status, message = failure
            metrics.upstream_errors.labels(engine.name, kind).inc()
            response.close()
            return openai_error(status, message, "timeout" if status == 504 else "upstream_error")
        response.release()
        media = response.headers.get("Content-Type", "application/json")
        return Response(content, status_code=response.status, headers={"Content-Type": media})

    def passthrough(response: aiohttp.ClientResponse, engine: EngineState) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            finished = False
            try:
                async for chunk in response.content.iter_any():
                    yield chunk
                finished = True
            except (aiohttp.ClientError, TimeoutError) as exc:
                # The engine died mid-answer: end the stream with an error event, not a hang.
                metrics.upstream_errors.labels(engine.name, "broken_stream").inc()
                error = {"error": {"message": f"engine {engine.name} failed mid-answer: {exc}",
                                   "type": "upstream_error", "code": "upstream_error"}}  # fmt: skip
                yield f"data: {json.dumps(error)}\n\n".encode()
            finally:
                engine.in_flight -= 1
                # A stream cut short (the client left) closes its connection: vLLM aborts the request.
                if finished:
                    response.release()
                else:
                    response.close()

        kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "x-request-id")}
        return StreamingResponse(chunks(), status_code=response.status, headers=kept)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            check_key(request)
        except Refused as refused:
            return refused.response
        card = {"id": settings.served_model_name, "object": "model", "owned_by": "kvtune",
                "max_model_len": settings.max_model_len}  # fmt: skip
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        ready = [engine.name for engine in engines if engine.ready]
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
