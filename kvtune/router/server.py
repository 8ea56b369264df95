"""The router as a server beside the engines `kvtune up` supervises: uvicorn in a background thread, with
the engine watches and KV-event followers running, supervised, on its event loop.

The KV-event socket stays on loopback: it takes whatever events reach it, with no authentication, so on
another interface anyone who reaches the port could steer the routing (or feed it garbage). An engine
serving on 0.0.0.0 sends its events to tcp://0.0.0.0:PORT, which Linux delivers to loopback, so the router
binds 127.0.0.1 for it; an engine on any other non-loopback address needs the explicit opt-in
RouterOptions.kv_events_off_loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge

from kvtune import kv_math, metrics
from kvtune.body_deadline import ROUTER_BODY_DEADLINE_S, BodyDeadline
from kvtune.config_errors import ConfigError
from kvtune.engine import free_port
from kvtune.profile import EngineProfile, is_loopback
from kvtune.router.background import Background
from kvtune.router.capture import CaptureSettings, TraceCapture
from kvtune.router.engine_watch import KvEventSource, WatchLimits
from kvtune.router.policies import ROUTER_POLICIES, EngineState, PolicyName, make_policy
from kvtune.router.prompt_tokens import ChatTokenizer, PromptEncoder, TokenizeLanes, prompt_tokens
from kvtune.router.proxy import ProxySettings, create_app
from kvtune.router.request_limits import default_max_body_bytes
from kvtune.router.routes import slow_body_error
from kvtune.router.upstream import Upstream

log = logging.getLogger(__name__)
# Until an engine reports its pool (vllm:cache_config_info), the sent-blocks LRU assumes this many.
DEFAULT_CAPACITY_BLOCKS = 4096


@dataclasses.dataclass(frozen=True)
class RouterTarget:
    name: str
    url: str
    kv_events_url: str | None = None
    capacity_blocks: int | None = None
    # Connect to kv_events_url (a worker's fan-out) instead of binding it (the engine's publisher connects).
    kv_events_connect: bool = False
    kv_events_replay: str | None = None  # the engine's replay endpoint, when it serves one

    @property
    def kv_events(self) -> KvEventSource | None:
        if self.kv_events_url is None:
            return None
        return KvEventSource(self.kv_events_url, self.kv_events_connect, self.kv_events_replay)


@dataclasses.dataclass(frozen=True)
class RouterOptions:
    policy: PolicyName
    host: str = "127.0.0.1"
    port: int = 8080
    load_factor: float = 1.5
    health_period_s: float = 1.0
    # Each /health or /metrics read, connect to last byte; slower is unhealthy.
    watch_deadline_s: float = 5.0
    # Receive KV events on an engine's non-loopback address (anyone reaching it can send events).
    kv_events_off_loopback: bool = False
    # Largest request body taken; None sizes it from max_model_len and the tokenizer (request_limits.py).
    max_body_bytes: int | None = None
    # Router processes sharing the port (workers.py); 1: the router runs in `kvtune up`'s own process.
    workers: int = 1
    # Each worker's own port (its /metrics and /health), chosen with the options so Prometheus can be
    # told before the workers start.
    worker_ports: tuple[int, ...] = ()
    # A request's whole body within this long of its arrival, else 408 (body_deadline.py).
    body_deadline_s: float = ROUTER_BODY_DEADLINE_S


class RouterServer:
    def __init__(
        self,
        options: RouterOptions,
        targets: Sequence[RouterTarget],
        settings: ProxySettings,
        tokenizer_path: str,
        tokenizer: ChatTokenizer | None = None,  # instead of loading it from tokenizer_path (tests)
        capture: CaptureSettings | None = None,  # `--capture-trace`: write what is served as a trace
        worker: int = 0,  # which router worker this is (0: the router inside `kvtune up`)
    ) -> None:
        if tokenizer is None:
            from kvtune.loadgen.text import load_tokenizer  # transformers: slow to import, needed only here

            loaded: Any = load_tokenizer(tokenizer_path)
            tokenizer = loaded
        encoder = PromptEncoder(tokenizer, settings.max_model_len)
        if settings.max_body_bytes is None:
            longest = encoder.token_bytes.longest if encoder.token_bytes is not None else None
            body_limit = default_max_body_bytes(settings.max_model_len, longest)
            settings = dataclasses.replace(settings, max_body_bytes=body_limit)
        self.settings = settings
        self.options = options
        self.engines = [
            EngineState(name=t.name, url=t.url, capacity_blocks=t.capacity_blocks or DEFAULT_CAPACITY_BLOCKS)
            for t in targets
        ]
        self.registry = CollectorRegistry()
        sources = {t.name: t.kv_events for t in targets}
        reported = Gauge(
            metrics.ROUTER_REPORTED_BLOCKS,
            "Blocks an engine's KV events say it holds, as the router's kv_events view has applied them",
            ["engine"],
            registry=self.registry,
        )
        for engine in self.engines:
            if sources[engine.name] is not None:
                reported.labels(engine.name).set_function(engine.reported.__len__)

        self.capture: TraceCapture | None = None
        if capture is not None:
            # An answer's text is counted uncached: it would only push prompts out of the encoder's cache.
            counting = tokenizer

            def count_text(text: str) -> int:
                return len(counting.encode(text, add_special_tokens=False))

            self.capture = TraceCapture(capture, settings.block_size, worker, count_text)
        self.app = create_app(
            settings,
            self.engines,
            make_policy(options.policy, options.load_factor),
            lambda body, endpoint: prompt_tokens(encoder, body, endpoint),
            registry=self.registry,
            capture=self.capture,
        )
        self.app.add_middleware(BodyDeadline, seconds=options.body_deadline_s, answer=slow_body_error)
        upstream: Upstream = self.app.state.upstream
        lanes: TokenizeLanes = self.app.state.tokenize_lanes
        watch = WatchLimits(period_s=options.health_period_s, deadline_s=options.watch_deadline_s)
        self.background = Background(self.engines, sources, upstream, self.app.state.metrics, watch)

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            tasks = [asyncio.create_task(coroutine) for coroutine in self.background.tasks()]
            try:
                if self._settle_s:
                    await self.background.settled(self._settle_s)
                yield
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await upstream.close()
                lanes.close()
                if self.capture is not None:
                    self.capture.close()

        self._settle_s = 0.0
        self.app.router.lifespan_context = lifespan
        config = uvicorn.Config(self.app, host=options.host, port=options.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.url = f"http://{options.host}:{options.port}"
        self._thread = threading.Thread(target=self.server.run, name="router", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the router did not start listening on {self.url} (see the log above)")
            time.sleep(0.05)

    def wait_seen_ready(self, names: Sequence[str]) -> list[str]:
        """Wait until the router's own health checks (one each health period) see NAMES ready; the names
        it still does not see after three periods."""
        deadline = time.monotonic() + 3 * self.options.health_period_s + 1
        while True:
            unseen = [engine.name for engine in self.engines if engine.name in names and not engine.ready]
            if not unseen or time.monotonic() > deadline:
                return unseen
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

    def serve(self, sockets: list[socket.socket], settle_s: float) -> None:
        """Serve on SOCKETS (bound; they listen once the engines read ready and the KV-event views are
        rebuilt, SETTLE_S at most) in this thread until SIGTERM or SIGINT: a router worker's whole life
        (worker.py)."""
        self._settle_s = settle_s
        self.server.run(sockets=sockets)


def kv_events_endpoint(profile: EngineProfile, off_loopback: bool = False) -> str | None:
    """Where the router receives PROFILE's KV events (None when it sends none); ConfigError for an
    address off loopback without OFF_LOOPBACK."""
    if profile.kv_events_port is None:
        return None
    host, port = profile.host, profile.kv_events_port
    if ":" in host:  # vLLM binds an IPv6 endpoint itself (its `::` test), where the router binds
        raise ConfigError(
            f"engine {profile.name!r}: host {host!r}: KV events from an IPv6 host are not supported; set "
            "host to 127.0.0.1 (or 0.0.0.0), or unset kv_events_port"
        )
    # Compared, not bound: the engine connects to 0.0.0.0, which Linux delivers to loopback.
    if host == "0.0.0.0":  # noqa: S104
        return f"tcp://127.0.0.1:{port}"
    if not is_loopback(host) and not off_loopback:
        raise ConfigError(
            f"engine {profile.name!r}: host {host!r}: the router would receive its KV events on "
            f"{host}:{port}, off loopback, where anyone who reaches that port can feed it events; set "
            "host to 127.0.0.1 (or 0.0.0.0, whose events stay on loopback), unset kv_events_port, or "
            "accept that with `kvtune up --router-kv-events-off-loopback`"
        )
    return profile.kv_events_url


def router_options_for(
    choice: str,
    profiles: Sequence[EngineProfile],
    port: int,
    load_factor: float,
    kv_events_off_loopback: bool = False,
    max_body_bytes: int | None = None,
    workers: int = 1,
) -> RouterOptions | None:
    """The router `kvtune up --router CHOICE` starts, or None (one engine with auto, or none)."""
    if workers < 1:
        raise ConfigError(
            f"--router-workers: {workers} must be at least 1 (1: the router in kvtune's process)"
        )
    if choice == "none" or (choice == "auto" and len(profiles) < 2):
        if workers > 1:
            why = "--router none" if choice == "none" else "one engine"
            raise ConfigError(
                f"--router-workers {workers}: no router runs here ({why}); "
                "start two engines or more (or pass --router POLICY), or drop --router-workers"
            )
        return None
    if load_factor <= 1:
        raise ConfigError(f"--router-load-factor: {load_factor} must be above 1 (1.5 is a sound start)")
    policy: PolicyName
    if choice == "auto":
        policy = "kv_events" if all(p.kv_events_port is not None for p in profiles) else "prefix"
    elif choice in ROUTER_POLICIES:
        policy = choice
    else:
        raise ConfigError(f"--router: {choice!r} is not one of auto, none, {', '.join(ROUTER_POLICIES)}")
    if policy == "kv_events":
        missing = [p.name for p in profiles if p.kv_events_port is None]
        if missing:
            workers_too = f" (with --router-workers {workers})" if workers > 1 else ""
            raise ConfigError(
                f"--router kv_events{workers_too}: engine {missing[0]!r} publishes no KV events; set "
                "kv_events_port in its profile, or use --router prefix"
            )
    for profile in profiles:  # refused now, before any engine starts
        kv_events_endpoint(profile, kv_events_off_loopback)
    return RouterOptions(
        policy=policy,
        port=port,
        load_factor=load_factor,
        kv_events_off_loopback=kv_events_off_loopback,
        max_body_bytes=max_body_bytes,
        workers=workers,
        worker_ports=tuple(free_port() for _ in range(workers)) if workers > 1 else (),
    )


def fleet_targets(
    options: RouterOptions, profiles: Sequence[EngineProfile], model_path: str
) -> tuple[ProxySettings, list[RouterTarget]]:
    """What a router in front of PROFILES' engines (serving MODEL_PATH) is set up with (credentials checked
    by the caller)."""
    first = profiles[0]
    geometry = kv_math.lookup_geometry(first.model)
    max_model_len = first.max_model_len or (geometry.max_position_embeddings if geometry else None)
    capacity = first.kv_capacity_tokens()
    key = first.api_key()
    settings = ProxySettings(
        served_model_name=first.api_model_name,
        block_size=first.effective_block_size,
        max_model_len=max_model_len,
        model_root=model_path,
        api_key=key,
        engine_api_key=key,
        max_body_bytes=options.max_body_bytes,
    )
    targets = [
        RouterTarget(
            p.name,
            p.url,
            kv_events_endpoint(p, options.kv_events_off_loopback),
            capacity // p.effective_block_size if capacity else None,
            kv_events_replay=p.kv_events_replay_url,
        )
        for p in profiles
    ]
    return settings, targets


def fleet_router(
    options: RouterOptions,
    profiles: Sequence[EngineProfile],
    model_path: str,
    capture: CaptureSettings | None = None,
) -> RouterServer:
    """The router in front of PROFILES' engines, in this process (writing CAPTURE when given)."""
    settings, targets = fleet_targets(options, profiles, model_path)
    return RouterServer(options, targets, settings, tokenizer_path=model_path, capture=capture)
