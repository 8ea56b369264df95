"""The router's OpenAI API: check the request, pick an engine by the policy, pass the answer through.

Nothing is forwarded that the router can refuse itself (admission.py); what passes goes to the engine
the policy picks and its answer comes back as it arrives (forwarding.py); routes.py holds the endpoints.
This module puts them together into one app per router, its state on `app.state`.
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from kvtune.router.admission import Admission, Refused, openai_error
from kvtune.router.capture import TraceCapture
from kvtune.router.forwarding import Forwarder
from kvtune.router.policies import EngineState, Policy
from kvtune.router.prompt_tokens import TokenizeLanes
from kvtune.router.proxy_settings import ProxySettings, Tokenize
from kvtune.router.request_limits import default_max_body_bytes
from kvtune.router.router_metrics import RouterMetrics
from kvtune.router.routes import add_routes
from kvtune.router.upstream import Upstream

__all__ = ["ProxySettings", "Refused", "Tokenize", "create_app", "openai_error"]


def create_app(
    settings: ProxySettings,
    engines: Sequence[EngineState],
    policy: Policy,
    tokenize: Tokenize,
    registry: CollectorRegistry | None = None,
    capture: TraceCapture | None = None,
) -> FastAPI:
    registry = registry or CollectorRegistry()
    metrics = RouterMetrics(registry)
    max_body = settings.max_body_bytes or default_max_body_bytes(settings.max_model_len, None)
    upstream = Upstream(settings.connect_timeout_s, settings.read_timeout_s)
    app = FastAPI(title="kvtune router", docs_url=None, redoc_url=None)
    app.state.engines, app.state.metrics, app.state.upstream = engines, metrics, upstream
    lanes = app.state.tokenize_lanes = TokenizeLanes()
    app.router.add_event_handler("shutdown", upstream.close)
    app.router.add_event_handler("shutdown", lanes.close)
    if capture is not None:
        app.router.add_event_handler("shutdown", capture.close)
    admission = Admission(settings, tokenize, max_body, lanes)
    forwarder = Forwarder(settings, engines, policy, upstream, metrics, capture)
    add_routes(app, admission, forwarder, metrics, registry)
    return app
