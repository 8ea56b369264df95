"""The router as a server beside the engines `kvtune up` supervises: uvicorn in a background thread, with
the engine watches and KV-event followers running on its event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvtune import kv_math, metrics
from kvtune.config_errors import ConfigError
from kvtune.profile import EngineProfile
from kvtune.router.engine_watch import follow_kv_events, forget_sent, watch_engine
from kvtune.router.policies import ROUTER_POLICIES, EngineState, PolicyName, make_policy
from kvtune.router.prompt_tokens import PromptEncoder, prompt_tokens
from kvtune.router.proxy import ProxySettings, create_app

log = logging.getLogger(__name__)
# Until an engine reports its pool (vllm:cache_config_info), the sent-blocks LRU assumes this many.
DEFAULT_CAPACITY_BLOCKS = 4096


@dataclass(frozen=True)
class RouterTarget:
    name: str
    url: str
    kv_events_url: str | None = None
    capacity_blocks: int | None = None


@dataclass(frozen=True)
class RouterOptions:
    policy: PolicyName
    host: str = "127.0.0.1"
    port: int = 8080
    load_factor: float = 1.5
    health_period_s: float = 1.0


class RouterServer:
    def __init__(
        self,
        options: RouterOptions,
        targets: Sequence[RouterTarget],
        settings: ProxySettings,
        tokenizer_path: str,
    ) -> None:
        from kvtune.loadgen.text import load_tokenizer  # transformers: slow to import, needed only here

        tokenizer: Any = load_tokenizer(tokenizer_path)
        encoder = PromptEncoder(tokenizer)
        self.options = options
        self.engines = [
            EngineState(name=t.name, url=t.url, capacity_blocks=t.capacity_blocks or DEFAULT_CAPACITY_BLOCKS)
            for t in targets
        ]
        self.registry = CollectorRegistry()
        resyncs = Counter(
            metrics.ROUTER_KV_EVENTS_RESYNCS.removesuffix("_total"),
            "Times an engine's KV-event view went stale (gap, unreadable batch, unknown parent) and the "
            "kv_events policy fell back to what the router sent it",
            ["engine", "cause"],
            registry=self.registry,
        )
        urls = {t.name: t.kv_events_url for t in targets}
        reported = Gauge(
            metrics.ROUTER_REPORTED_BLOCKS,
            "Blocks an engine's KV events say it holds, as the router's kv_events view has applied them",
            ["engine"],
            registry=self.registry,
        )
        for engine in self.engines:
            if urls[engine.name] is not None:
                reported.labels(engine.name).set_function(engine.reported.__len__)

        def on_resync(engine: EngineState, cause: str) -> None:
            log.warning(
                "engine %s: KV-event view stale (%s); routing it by what was sent", engine.name, cause
            )
            resyncs.labels(engine.name, cause.split(" (")[0]).inc()

        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
            async with httpx.AsyncClient() as watch_client:
                tasks = [
                    asyncio.create_task(watch_engine(e, watch_client, options.health_period_s, forget_sent))
                    for e in self.engines
                ]
                tasks += [
                    asyncio.create_task(follow_kv_events(e, url, on_resync))
                    for e in self.engines
                    if (url := urls[e.name]) is not None
                ]
                try:
                    yield
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    await self.app.state.upstream.close()

        self.app = create_app(
            settings,
            self.engines,
            make_policy(options.policy, options.load_factor),
            lambda body, endpoint: prompt_tokens(encoder, body, endpoint),
            registry=self.registry,
        )
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


def router_options_for(
    choice: str, profiles: Sequence[EngineProfile], port: int, load_factor: float
) -> RouterOptions | None:
    """The router `kvtune up --router CHOICE` starts, or None (one engine with auto, or none)."""
    if choice == "none" or (choice == "auto" and len(profiles) < 2):
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
            raise ConfigError(
                f"--router kv_events: engine {missing[0]!r} publishes no KV events; set kv_events_port in "
                "its profile, or use --router prefix"
            )
    return RouterOptions(policy=policy, port=port, load_factor=load_factor)


def fleet_router(options: RouterOptions, profiles: Sequence[EngineProfile], model_path: str) -> RouterServer:
    """The router in front of PROFILES' engines (credentials checked by the caller before any start)."""
    first = profiles[0]
    geometry = kv_math.lookup_geometry(first.model)
    max_model_len = first.max_model_len or (geometry.max_position_embeddings if geometry else None)
    capacity = first.kv_capacity_tokens()
    key = first.api_key()
    settings = ProxySettings(
        served_model_name=first.api_model_name,
        block_size=first.effective_block_size,
        max_model_len=max_model_len,
        api_key=key,
        engine_api_key=key,
    )
    targets = [
        RouterTarget(p.name, p.url, p.kv_events_url, capacity // p.effective_block_size if capacity else None)
        for p in profiles
    ]
    return RouterServer(options, targets, settings, tokenizer_path=model_path)
