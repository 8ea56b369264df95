"""A loopback front for kvtune's load runner in front of kvtune's router: the router's API passed through,
and the engines' own /metrics merged into one exposition (each sample labelled by its replica).

Why it exists: the load runner (kvtune.loadgen.runner) reads engine metrics at the URL it loads and refuses
a URL whose /metrics holds no vllm: metric, and kvtune's router serves its own metrics only. So a load step
through the router cannot be measured by the runner as is; this front lets the fleet benchmark measure it
with the sweep's own runner and confidence rule. It adds one loopback hop (aiohttp, streamed through).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import aiohttp
from aiohttp import web

from kvtune.engine import free_port

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
# An answer streams for as long as its engine takes; a read that waits this long has stalled.
READ_TIMEOUT_S = 600.0
# The request headers passed on (the body's type and an API key); hop-by-hop ones are the front's own.
PASSED_HEADERS = ("content-type", "authorization", "accept")


def _family(line: str) -> str:
    """The metric a `# HELP` / `# TYPE` line speaks of."""
    parts = line.split()
    return parts[2] if len(parts) > 2 else ""


def labelled(line: str, replica: int) -> str:
    """A sample line of the exposition text with `replica="REPLICA"` added to its labels."""
    brace, space = line.find("{"), line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        return f'{line[: brace + 1]}replica="{replica}",{line[brace + 1 :]}'
    return f'{line[:space]}{{replica="{replica}"}}{line[space:]}'


def merge_expositions(texts: Sequence[str]) -> str:
    """Several engines' Prometheus text as one: each family's HELP and TYPE once, then its samples from every
    engine, each labelled with the engine's index (replica="i"), so no series is exported twice. A sample
    belongs to the family whose HELP or TYPE line came last (as prometheus_client, vLLM's, writes them)."""
    headers: dict[str, list[str]] = {"": []}
    header_from: dict[str, int] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                if line.startswith(("# HELP ", "# TYPE ")):
                    family = _family(line)
                    headers.setdefault(family, [])
                    if header_from.setdefault(family, replica) == replica:
                        headers[family].append(line)
                continue
            samples.setdefault(family, []).append(labelled(line, replica))
    out: list[str] = []
    for family, lines in headers.items():
        out += lines + samples.get(family, [])
    return "\n".join(out) + "\n"


class FleetFront:
    """The front on a free loopback port, in a thread of its own, while the `with` lasts."""

    def __init__(self, router_url: str, engine_urls: Sequence[str]) -> None:
        self.router_url = router_url.rstrip("/")
        self.engine_urls = [url.rstrip("/") for url in engine_urls]
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleet-front", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _serve(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=READ_TIMEOUT_S)
        self._session = aiohttp.ClientSession(timeout=timeout)
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, HOST, self.port).start()

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self._session is not None
        texts = []
        for url in self.engine_urls:
            async with self._session.get(f"{url}/metrics") as answer:
                if answer.status != 200:
                    return web.Response(status=502, text=f"{url}/metrics answered {answer.status}")
                texts.append(await answer.text())
        return web.Response(text=merge_expositions(texts), content_type="text/plain", charset="utf-8")

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {name: value for name, value in request.headers.items() if name.lower() in PASSED_HEADERS}
        body = await request.read()
        async with self._session.request(
            request.method, f"{self.router_url}{request.path_qs}", data=body or None, headers=headers
        ) as upstream:
            response = web.StreamResponse(status=upstream.status)
            if "content-type" in upstream.headers:
                response.headers["content-type"] = upstream.headers["content-type"]
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:
                # The client went away (a stream read to its end and closed, or a stopped user): leaving the
                # upstream request closes it, and the router aborts it at the engine.
                pass
            return response

    async def _close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def __enter__(self) -> Self:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(START_TIMEOUT_S)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _exc: BaseException | None, _tb: TracebackType | None
    ) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(START_TIMEOUT_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(START_TIMEOUT_S)
        self._loop.close()
