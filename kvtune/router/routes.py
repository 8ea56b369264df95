"""The router's HTTP endpoints: the two OpenAI completion routes, the model list, health and metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvtune.body_deadline import BodyDeadlineExceeded
from kvtune.router.admission import Admission, Refused
from kvtune.router.forwarding import Forwarder
from kvtune.router.policies import EngineState
from kvtune.router.router_metrics import RouterMetrics


async def admit_and_forward(
    request: Request, endpoint: str, admission: Admission, forwarder: Forwarder, metrics: RouterMetrics
) -> Response:
    """Answered by the router itself when refused (counted by reason), else by the engine chosen."""
    arrived = time.perf_counter()
    ticket = forwarder.arrival()
    try:
        admitted = await admission.admit(request, endpoint)
        return await forwarder.forward(admitted, endpoint, arrived, ticket)
    except Refused as refused:
        metrics.refused.labels(refused.reason).inc()
        return refused.response
    except BodyDeadlineExceeded:
        metrics.refused.labels("slow_body").inc()
        raise  # answered 408 by the deadline's middleware, whatever is returned here
    finally:
        ticket.unless_streaming_drop()  # refused, failed or cancelled: not in the capture


def slow_body_error(message: str) -> dict[str, object]:
    """The 408 of a body that did not arrive in time, as an OpenAI-style error (body_deadline.py)."""
    return {"error": {"message": message, "type": "timeout_error", "param": None, "code": "request_timeout"}}


def model_list(request: Request, admission: Admission) -> Response:
    """The one model the router serves, as an OpenAI model list (behind the API key, like the engines')."""
    try:
        admission.check_key(request)
    except Refused as refused:
        return refused.response
    settings = admission.settings
    card = {"id": settings.served_model_name, "object": "model", "owned_by": "kvtune",
            "root": settings.model_root or settings.served_model_name,
            "max_model_len": settings.max_model_len}  # fmt: skip
    return JSONResponse({"object": "list", "data": [card]})


def health_answer(engines: Sequence[EngineState]) -> Response:
    """200 with the ready engines' names while any is ready, else 503."""
    ready = [engine.name for engine in engines if engine.ready]
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


def add_routes(
    app: FastAPI,
    admission: Admission,
    forwarder: Forwarder,
    metrics: RouterMetrics,
    registry: CollectorRegistry,
) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await admit_and_forward(request, "/v1/completions", admission, forwarder, metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await admit_and_forward(request, "/v1/chat/completions", admission, forwarder, metrics)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return model_list(request, admission)

    @app.get("/health")
    async def health() -> Response:
        return health_answer(forwarder.engines)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
