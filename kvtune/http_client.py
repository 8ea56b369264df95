"""One policy for every HTTP call kvtune makes as a client: bounded in time and in memory, whatever answers.

A server kvtune reads from (an engine, Prometheus, Grafana, a URL a user typed) may be down, slow, lying or
hostile. httpx's timeouts are per socket operation: a server that sends one byte every few seconds, or an
endless body, keeps a plain `client.get` busy and growing for ever. Here every call has

- a connect timeout and a per-read timeout (a server that goes quiet),
- a total deadline, checked between the chunks of a streamed read (a slow-loris that keeps sending),
- a cap on the decoded body size (an endless or huge body, a compression bomb).

A call that breaks a bound raises `LimitExceeded`, an `httpx.HTTPError`, so the callers' existing handling of
network errors covers it. The worst case of a call is its deadline plus one read timeout: httpx cannot cut a
read already waiting, and the read timeout bounds that wait (it is never longer than the deadline itself).

Bodies are decoded here, not by httpx: httpx inflates each network read whole, so one 64 KiB read of a
brotli or a doubly gzipped bomb becomes gigabytes before any cap is checked. A call asks for gzip or
deflate only, inflates at most a chunk at a time, and refuses an encoding it did not ask for
(`UnexpectedEncoding`). Redirects are never followed, whatever the client says.

One credential per request: a URL's `user:password@` is HTTP Basic auth, an API key is `Authorization:
Bearer`, and a request carries one Authorization header. httpx would quietly let the URL's Basic auth replace
the key; here a URL with a user (or password) beside an Authorization header is refused (`CredentialConflict`,
`credential_conflict` for a check before anything starts), and either alone is sent as given.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Generator, Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 10.0
DEADLINE_S = 30.0
# A vLLM engine's /metrics is ~50 KB, a Prometheus query result or a model list a few KB; 16 MiB leaves
# room for engines with hundreds of adapters while refusing a body that would cost a large share of memory.
MAX_RESPONSE_BYTES = 16 * 2**20


# What a call accepts (httpx would also offer br and zstd when their packages are installed); each inflates
# at most this many bytes per step.
ACCEPT_ENCODING = "gzip, deflate"
_INFLATE_STEP = 64 * 1024


class LimitExceeded(httpx.HTTPError):
    """The server kept sending past the call's deadline or size cap; str() says which and the bound."""


class UnexpectedEncoding(httpx.DecodingError):
    """The body came in an encoding the call did not ask for (br, zstd, gzip twice), or does not inflate."""


class CredentialConflict(httpx.HTTPError):
    """A URL with a user and password and an API key (or token) for the same request; str() says which to
    drop, with the password hidden."""


def _has_userinfo(url: str | httpx.URL) -> bool:
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return False
    return bool(parsed.userinfo)


def credential_conflict(url: str, api_key: bool, *, key_name: str = "an API key") -> str | None:
    """Why URL and an API key cannot both be used (the URL holds `user:password@`), or None. KEY_NAME says
    what the key is called where it was given ("--api-key-env", "a token")."""
    if not (api_key and _has_userinfo(url)):
        return None
    return (
        f"{shown_url(url)} holds a user and password (HTTP Basic auth) and {key_name} is given too (Bearer); "
        "a request carries one Authorization header: remove user:password@ from the URL, or give no key"
    )


class OneCredential(httpx.Auth):
    """A client's auth: the URL's `user:password@` becomes Basic auth when no Authorization header is set
    (a key, a token), and CredentialConflict when one is, before anything is sent. httpx itself would let the
    URL replace the key; a client given this auth never consults the URL on its own."""

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        url = request.url
        if url.userinfo:
            if "Authorization" in request.headers:
                problem = credential_conflict(str(url), api_key=True)
                raise CredentialConflict(problem or "two credentials for one request")
            yield from httpx.BasicAuth(url.username, url.password).auth_flow(request)
            return
        yield request


def new_client(headers: Mapping[str, str] | None = None) -> httpx.Client:
    """An httpx client with the policy's socket timeouts; use `get` on it for the deadline and size cap.

    Redirects are not followed: a server that redirects kvtune elsewhere would receive its API key there.
    A URL's user and password are sent only when HEADERS hold no Authorization (OneCredential).
    """
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    return httpx.Client(
        headers=dict(headers or {}), timeout=timeout, follow_redirects=False, auth=OneCredential()
    )


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
    started = time.monotonic()
    with client.stream(
        method,
        url,
        params=params,
        json=json_body,
        headers={"Accept-Encoding": ACCEPT_ENCODING},
        timeout=_within(client.timeout, deadline_s),
        follow_redirects=False,  # a redirect elsewhere would carry the client's credentials there
    ) as response:
        try:  # a transport that answers from memory (httpx.MockTransport) hands over a body read already
            raw_chunks: Iterable[bytes] = [response.content]
            encoding = ""  # and decoded
        except httpx.ResponseNotRead:
            raw_chunks, encoding = response.iter_raw(), response.headers.get("Content-Encoding", "")
        body = read_body(
            raw_chunks, encoding, url, started=started, deadline_s=deadline_s, max_bytes=max_bytes
        )
    # The body is decoded already: the new response must not decode it again.
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() != "content-encoding"]
    return httpx.Response(response.status_code, headers=headers, content=body, request=response.request)


def read_body(
    raw_chunks: Iterable[bytes],
    content_encoding: str,
    url: str,
    *,
    started: float,
    deadline_s: float = DEADLINE_S,
    max_bytes: int = MAX_RESPONSE_BYTES,
) -> bytes:
    """A response's whole body from its chunks as received, inflated here (gzip or deflate, a step at a
    time), refused past `max_bytes` or once `deadline_s` from `started` (a time.monotonic() reading taken
    before the call) has passed. Other HTTP clients (requests, under grafana-client) read through it too,
    so every call kvtune makes has the same bounds."""
    deadline = started + deadline_s

    def check_deadline() -> None:
        if time.monotonic() > deadline:
            raise LimitExceeded(
                f"{shown_url(url)} was still sending after {deadline_s:g} s; the server is stalling"
            )

    check_deadline()  # headers that came just in time leave no room for a body
    inflate = _inflater(content_encoding, url)
    chunks: list[bytes] = []
    received = size = 0
    too_much = f"{shown_url(url)} sent more than {_bytes(max_bytes)}; not the server expected"
    for raw in raw_chunks:
        # What was received counts as well as what it inflates to: bytes after the end of a compressed
        # stream are dropped, but are still read.
        received += len(raw)
        for chunk in [raw] if inflate is None else inflate.pieces(raw):
            size += len(chunk)
            if size > max_bytes:
                raise LimitExceeded(too_much)
            chunks.append(chunk)
        if received > max_bytes:
            raise LimitExceeded(too_much)
        check_deadline()
    return b"".join(chunks)


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:g} {unit}"
    return f"{count:,} bytes"


def _within(timeout: httpx.Timeout, deadline_s: float) -> httpx.Timeout:
    """The client's socket timeouts, none longer than the call's deadline (a short call stays short)."""
    return httpx.Timeout(
        connect=capped(timeout.connect, deadline_s),
        read=capped(timeout.read, deadline_s),
        write=capped(timeout.write, deadline_s),
        pool=capped(timeout.pool, deadline_s),
    )


def capped(timeout_s: float | None, deadline_s: float) -> float:
    """A socket timeout no longer than the call's deadline (None, no timeout, becomes the deadline)."""
    return deadline_s if timeout_s is None else min(timeout_s, deadline_s)


class _Inflater:
    """A gzip or deflate body inflated at most _INFLATE_STEP bytes at a time, so a bomb is caught at the
    cap instead of after it is in memory."""

    def __init__(self, encoding: str, url: str) -> None:
        self.encoding = encoding
        self.url = url
        # 32 + MAX_WBITS reads a gzip or a zlib header, whichever comes; a raw deflate stream has neither.
        self._zlib = zlib.decompressobj(32 + zlib.MAX_WBITS)
        self._started = False

    def pieces(self, data: bytes) -> Iterator[bytes]:
        while not self._zlib.eof:
            try:
                piece = self._zlib.decompress(data, _INFLATE_STEP)
            except zlib.error as exc:
                if self.encoding == "deflate" and not self._started:  # some servers send raw deflate
                    self._zlib, self._started = zlib.decompressobj(-zlib.MAX_WBITS), True
                    continue
                raise UnexpectedEncoding(
                    f"{shown_url(self.url)} sent a {self.encoding} body that does not inflate ({exc})"
                ) from None
            self._started = True
            data = self._zlib.unconsumed_tail
            if piece:
                yield piece
            # A full step may leave output zlib holds for input it took in whole: ask again until less comes.
            if not data and len(piece) < _INFLATE_STEP:
                return


def _inflater(encoding: str, url: str) -> _Inflater | None:
    """None for a plain body; UnexpectedEncoding for an encoding a call does not ask for."""
    name = encoding.strip().lower()
    if name in ("", "identity"):
        return None
    if name not in ("gzip", "deflate"):
        raise UnexpectedEncoding(
            f"{shown_url(url)} answered with Content-Encoding {encoding[:40]!r}, which kvtune did not ask "
            f"for (it accepts {ACCEPT_ENCODING})"
        )
    return _Inflater(name, url)


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


# "user:password@" where no scheme comes before it: the user is kept, the password hidden.
_USERINFO = re.compile(r"^([^:/@\s]*):[^@/\s]+@")


def json_kind(value: object) -> str:
    """What a JSON value is, for a message about an answer of the wrong shape: "a list", "an object"..."""
    if isinstance(value, dict):
        return "an object"
    names = {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return f"a {names.get(type(value), type(value).__name__)}"


def shown_url(url: str) -> str:
    """`url` as it may be printed or logged: a password in it (http://user:pass@host) replaced by ***, and a
    user without a password (http://TOKEN@host, how some services take a token) replaced whole."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            if parts.username:
                return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))
            # Without a scheme ("user:pass@host:8000") urlsplit finds no authority, and so no password.
            return _USERINFO.sub(r"\1:***@", url)
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 address goes back in brackets
            host = f"[{host}]"
        port = f":{parts.port}" if parts.port is not None else ""
        netloc = f"{parts.username}:***@{host}{port}" if parts.username else f":***@{host}{port}"
    except ValueError:  # an unparseable port: show nothing of the authority rather than risk the password
        return "<a URL that cannot be parsed>"
    return urlunsplit(parts._replace(netloc=netloc))
