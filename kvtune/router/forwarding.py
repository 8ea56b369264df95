"""An admitted request's way to an engine and its answer's way back.

The policy picks the engine; the client's own bytes go upstream. Streams are passed through chunk by
chunk; when the client goes away the upstream response is closed, which makes vLLM abort the request. A
whole answer is read in full first, within its deadline and size cap. Upstream calls are bounded as
upstream.py says, and an engine that refuses the connection is marked unready and the request tried once
on another.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response, StreamingResponse

from kvtune.router.admission import Admitted, openai_error
from kvtune.router.capture import NO_TICKET, CapturedStream, Ticket, TraceCapture
from kvtune.router.policies import Decision, EngineState, NoEngineReady, Policy, RoutedRequest
from kvtune.router.prefix_index import block_hashes
from kvtune.router.proxy_settings import ProxySettings
from kvtune.router.router_metrics import RouterMetrics
from kvtune.router.upstream import AnswerTooLarge, Upstream, read_capped

# One engine, then one other when the first refuses the connection.
ATTEMPTS = 2


@dataclass(frozen=True)
class Forwarder:
    settings: ProxySettings
    engines: Sequence[EngineState]
    policy: Policy
    upstream: Upstream
    metrics: RouterMetrics
    capture: TraceCapture | None = None  # `kvtune up --capture-trace`: what is served becomes a trace

    def arrival(self) -> Ticket:
        """A request arrived: its place in the capture (NO_TICKET when nothing is captured)."""
        return self.capture.arrive() if self.capture is not None else NO_TICKET

    async def forward(
        self, request: Admitted, endpoint: str, arrived: float, ticket: Ticket = NO_TICKET
    ) -> Response:
        """The engine's answer to `request`, or an OpenAI-style error saying why there is none. TICKET
        ends with a whole answer here, with a stream when the stream ends (the caller drops it otherwise)."""
        routed = RoutedRequest(
            blocks=block_hashes(request.tokens, self.settings.block_size), session=request.session
        )
        streamed = bool(request.body.get("stream"))
        # A streamed answer is bounded per read only; a whole one from sending it to its last byte.
        deadline = None if streamed else asyncio.get_running_loop().time() + self.settings.answer_deadline_s
        tried: set[str] = set()
        for _attempt in range(ATTEMPTS):
            candidates = [engine for engine in self.engines if engine.name not in tried]
            try:
                decision = self.policy.choose(routed, candidates)
            except NoEngineReady as exc:
                return openai_error(503, f"no engine can take the request: {exc}", "service_unavailable")
            engine = decision.engine
            tried.add(engine.name)
            self.metrics.overhead.observe(time.perf_counter() - arrived)
            answer = await self._send(engine, endpoint, request.raw, deadline)
            if answer is None:
                continue
            if isinstance(answer, Response):
                return answer
            self._count(decision, routed, answer)
            if streamed:
                return self._passthrough(answer, engine, ticket, request.tokens)
            whole = await self._whole(answer, engine, deadline)
            if whole.status_code < 400:
                ticket.answered(request.tokens, bytes(whole.body))
            return whole
        return openai_error(503, "every engine tried refused the connection", "service_unavailable")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.settings.engine_api_key:
            headers["Authorization"] = f"Bearer {self.settings.engine_api_key}"
        return headers

    async def _send(
        self, engine: EngineState, endpoint: str, raw: bytes, deadline: float | None
    ) -> aiohttp.ClientResponse | Response | None:
        """The engine's response; an error to answer when the call failed; None when the engine refused
        the connection (it is marked unready, and another may be tried)."""
        engine.in_flight += 1
        try:
            # The client's own bytes go upstream: nothing is re-encoded on the hot path.
            async with asyncio.timeout_at(deadline):
                return await self.upstream.post(engine.url + endpoint, raw, self._headers())
        except aiohttp.ClientConnectorError:
            engine.in_flight -= 1
            engine.ready = False  # the health loop brings it back when it answers again
            self.metrics.upstream_errors.labels(engine.name, "connect").inc()
            return None
        except TimeoutError:
            engine.in_flight -= 1
            self.metrics.upstream_errors.labels(engine.name, "timeout").inc()
            return openai_error(504, f"engine {engine.name} did not answer in time", "timeout")
        except aiohttp.ClientError as exc:
            engine.in_flight -= 1
            self.metrics.upstream_errors.labels(engine.name, "transport").inc()
            return openai_error(502, f"engine {engine.name} failed: {exc}", "upstream_error")

    def _count(self, decision: Decision, routed: RoutedRequest, response: aiohttp.ClientResponse) -> None:
        engine = decision.engine
        engine.routed += 1
        self.metrics.requests.labels(engine.name, self.policy.name, decision.reason).inc()
        self.metrics.matched_blocks.observe(decision.matched_blocks)
        if response.status < 400:
            engine.took(routed.blocks)

    async def _whole(
        self, response: aiohttp.ClientResponse, engine: EngineState, deadline: float | None
    ) -> Response:
        """A non-streamed answer read in full first (within the deadline and the size cap), so an engine
        dying, stalling or babbling mid-answer is a clean error."""
        failure: tuple[str, int, str] | None = None
        try:
            async with asyncio.timeout_at(deadline):
                content = await read_capped(response, self.settings.max_answer_bytes)
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
            self.metrics.upstream_errors.labels(engine.name, kind).inc()
            response.close()
            return openai_error(status, message, "timeout" if status == 504 else "upstream_error")
        response.release()
        media = response.headers.get("Content-Type", "application/json")
        return Response(content, status_code=response.status, headers={"Content-Type": media})

    def _passthrough(
        self, response: aiohttp.ClientResponse, engine: EngineState, ticket: Ticket, tokens: list[int]
    ) -> StreamingResponse:
        kept = {k: v for k, v in response.headers.items() if k.lower() in ("content-type", "x-request-id")}
        captured = ticket.stream(tokens) if response.status < 400 else None
        chunks = self._chunks(response, engine, captured)
        return StreamingResponse(chunks, status_code=response.status, headers=kept)

    async def _chunks(
        self, response: aiohttp.ClientResponse, engine: EngineState, captured: CapturedStream | None
    ) -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in response.content.iter_any():
                if captured is not None:
                    captured.feed(chunk)
                yield chunk
            finished = True
        except (aiohttp.ClientError, TimeoutError) as exc:
            # The engine died mid-answer: end the stream with an error event, not a hang.
            self.metrics.upstream_errors.labels(engine.name, "broken_stream").inc()
            error = {"error": {"message": f"engine {engine.name} failed mid-answer: {exc}",
                               "type": "upstream_error", "code": "upstream_error"}}  # fmt: skip
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            engine.in_flight -= 1
            if captured is not None:  # served, however far the stream got
                captured.end()
            # A stream cut short (the client left) closes its connection: vLLM aborts the request.
            if finished:
                response.release()
            else:
                response.close()
