"""One policy for every HTTP call kvtune makes as a client: bounded in time and in memory, whatever answers.

A server kvtune reads from (an engine, Prometheus, Grafana, a URL a user typed) may be down, slow, lying or
hostile. httpx's timeouts are per socket operation: a server that sends one byte every few seconds, or an
endless body, keeps a plain `client.get` busy and growing for ever. Here every call has

- a connect timeout and a per-read timeout (a server that goes quiet),
- a total deadline, checked between the chunks of a streamed read (a slow-loris that keeps sending),
- a cap on the decoded body size (an endless or huge body, a compression bomb).

A call that breaks a bound raises `LimitExceeded`, an `httpx.HTTPError`, so the callers' existing handling of
network errors covers it. The worst case of a call is its deadline plus one read timeout: httpx cannot cut a
read already waiting, and the read timeout bounds that wait.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 10.0
DEADLINE_S = 30.0
# A vLLM engine's /metrics is ~50 KB, a Prometheus query result or a model list a few KB; 16 MiB leaves
# room for engines with hundreds of adapters while refusing a body that would cost a large share of memory.
MAX_RESPONSE_BYTES = 16 * 2**20


class LimitExceeded(httpx.HTTPError):
    """The server kept sending past the call's deadline or size cap; str() says which and the bound."""


def new_client(headers: Mapping[str, str] | None = None) -> httpx.Client:
    """An httpx client with the policy's socket timeouts; use `get` on it for the deadline and size cap.

    Redirects are not followed: a server that redirects kvtune elsewhere would receive its API key there.
    """
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    return httpx.Client(headers=dict(headers or {}), timeout=timeout, follow_redirects=False)


def get(
    client: httpx.Client,
    url: str,
    *,
    params: Mapping[str, str] | None = None,
    deadline_s: float = DEADLINE_S,
    max_bytes: int = MAX_RESPONSE_BYTES,
) -> httpx.Response:
    """GET `url` and read its whole body within `deadline_s` and `max_bytes`; LimitExceeded otherwise."""
    return request(client, "GET", url, params=params, deadline_s=deadline_s, max_bytes=max_bytes)


def request(
    client: httpx.Client,
    method: str,
    url: str,
    *,
    params: Mapping[str, str] | None = None,
    json_body: Any = None,
    deadline_s: float = DEADLINE_S,
    max_bytes: int = MAX_RESPONSE_BYTES,
) -> httpx.Response:
    """One call whose body is read in chunks against the deadline and the cap; the response is complete."""
    deadline = time.monotonic() + deadline_s
    with client.stream(method, url, params=params, json=json_body) as response:
        chunks: list[bytes] = []
        size = 0
        # iter_bytes decodes gzip/deflate: the cap counts what would land in memory, not what was sent.
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > max_bytes:
                raise LimitExceeded(
                    f"{shown_url(url)} sent more than {max_bytes // 2**20} MiB; not the server expected"
                )
            if time.monotonic() > deadline:
                raise LimitExceeded(
                    f"{shown_url(url)} was still sending after {deadline_s:g} s; the server is stalling"
                )
            chunks.append(chunk)
    # The body is decoded already: the new response must not decode it again.
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-encoding"]
    return httpx.Response(
        response.status_code, headers=headers, content=b"".join(chunks), request=response.request
    )


class NotJson(ValueError):
    """A body that is not strict JSON (RFC 8259): not JSON at all, or with NaN/Infinity in it."""


def strict_json(response: httpx.Response) -> Any:
    """The body as JSON; NotJson for anything else, including the NaN/Infinity Python's parser accepts."""

    def refuse(constant: str) -> Any:
        raise NotJson(f"{constant} is not a JSON number")

    try:
        return json.loads(response.content, parse_constant=refuse)
    except NotJson:
        raise
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise NotJson(str(exc).split(":", 1)[0]) from None


def shown_url(url: str) -> str:
    """`url` as it may be printed or logged: a password in it (http://user:pass@host) replaced by ***."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 address goes back in brackets
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        netloc = f"{parts.username}:***@{host}{port}" if parts.username else f":***@{host}{port}"
    except ValueError:  # an unparseable port: show nothing of the authority rather than risk the password
        return "<a URL that cannot be parsed>"
    return urlunsplit(parts._replace(netloc=netloc))
