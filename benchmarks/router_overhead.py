"""The router's own added latency: requests straight to a fast local upstream, and through kvtune's router.

Each party in its own process, as deployed: the upstream (it answers at once, so what is left is the
router), the router (the RouterServer `kvtune up` runs, policy prefix, with the served model's tokenizer)
and this client. Requests take the paths in turn, so all see the same machine noise. Every prompt is
distinct, in two kinds: `shared` ones start with the same long text and end in a numbered tail (the
traffic a prefix-aware router is for: the router reuses the shared text's tokens), `unique` ones start
with their number (nothing to reuse: the router tokenises each in full).

    python -m benchmarks.router_overhead [--requests 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from kvtune.engine import free_port
from kvtune.loadgen.text import TextMaker, load_tokenizer
from kvtune.model_store import ensure_model
from kvtune.processes import stop_group

MODEL = "smollm2-135m"
PROMPT_TOKENS = 600
BLOCK_SIZE = 128


def serve_upstream(port: int) -> None:
    """An OpenAI completions endpoint that answers at once, with the /health and /metrics the router polls."""
    app = FastAPI()
    answer = {"choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": {"prompt_tokens": 1}}

    @app.post("/v1/completions")
    async def completions() -> JSONResponse:
        return JSONResponse(answer)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def serve_router(port: int, upstream_url: str, model_path: str) -> None:
    from kvtune.router.proxy import ProxySettings
    from kvtune.router.server import RouterOptions, RouterServer, RouterTarget

    router = RouterServer(
        RouterOptions(policy="prefix", port=port),
        [RouterTarget("fast", upstream_url, capacity_blocks=4096)],
        ProxySettings(served_model_name=MODEL, block_size=BLOCK_SIZE, max_model_len=8192),
        tokenizer_path=model_path,
    )
    router.start()
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(3600)


@contextlib.contextmanager
def child(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "benchmarks.router_overhead", *args]
    proc = subprocess.Popen(command, start_new_session=True)
    try:
        yield proc
    finally:
        stop_group(proc, grace_s=5)


def wait_ready(client: httpx.Client, url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if client.get(url, timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not come up (exit code {proc.poll()})")
        time.sleep(0.2)


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return 1000 * ordered[len(ordered) // 2], 1000 * ordered[int(0.99 * len(ordered))]


def measure(model_path: str, requests: int = 2000) -> dict[str, float]:
    """p50/p99 in ms of REQUESTS completions straight to the upstream and as many of each kind through
    the router; `added_*` is the router's share (`added_unique_*` for prompts it has no tokens of)."""
    upstream_port, router_port = free_port(), free_port()
    base = TextMaker(load_tokenizer(model_path)).text(PROMPT_TOKENS, "overhead")
    upstream_url = f"http://127.0.0.1:{upstream_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    with (
        child("upstream", str(upstream_port)) as upstream,
        child("router", str(router_port), upstream_url, model_path) as router,
        httpx.Client(timeout=10) as client,
    ):
        wait_ready(client, upstream_url + "/health", upstream)
        wait_ready(client, router_url + "/health", router)  # 200 once it has seen the upstream ready
        paths: dict[str, tuple[str, Callable[[int], str]]] = {
            "direct": (upstream_url, lambda index: f"{base} Request {index}."),
            "router": (router_url, lambda index: f"{base} Request {index}."),
            "router_unique": (router_url, lambda index: f"Request {index}. {base}"),
        }
        timings: dict[str, list[float]] = {path: [] for path in paths}
        for index in range(requests * len(paths)):
            path = list(paths)[index % len(paths)]
            url, prompt = paths[path]
            body: dict[str, Any] = {"model": MODEL, "prompt": prompt(index), "max_tokens": 1}
            start = time.perf_counter()
            client.post(url + "/v1/completions", json=body).raise_for_status()
            timings[path].append(time.perf_counter() - start)
    out: dict[str, float] = {}
    for path, values in timings.items():
        out[f"{path}_p50_ms"], out[f"{path}_p99_ms"] = percentiles(values[requests // 10 :])  # past warm-up
    for path in ("router", "router_unique"):
        for quantile in ("p50", "p99"):
            out[f"{path.replace('router', 'added')}_{quantile}_ms"] = (
                out[f"{path}_{quantile}_ms"] - out[f"direct_{quantile}_ms"]
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_overhead", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="role")
    upstream = sub.add_parser("upstream", help="(internal) serve the fast upstream")
    upstream.add_argument("port", type=int)
    router = sub.add_parser("router", help="(internal) serve the router in front of it")
    router.add_argument("port", type=int)
    router.add_argument("upstream_url")
    router.add_argument("model_path")
    parser.add_argument("--requests", type=int, default=2000, help="requests each way (default 2000)")
    args = parser.parse_args(argv)
    if args.role == "upstream":
        serve_upstream(args.port)
        return 0
    if args.role == "router":
        serve_router(args.port, args.upstream_url, args.model_path)
        return 0
    result = measure(str(ensure_model(MODEL)), args.requests)
    print(", ".join(f"{key} {value:.2f}" for key, value in result.items()))
    return 0 if result["added_p99_ms"] < 2.0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
