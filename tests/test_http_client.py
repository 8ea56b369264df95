"""kvtune's one HTTP client policy against servers that stall, flood, compress, redirect or lie.

Each bound is checked against a real local server (tests/hostile_servers.py) with bounds a few times
smaller than the policy's defaults, so the file stays fast; what is asserted is the mechanism (which error,
how much memory), with generous margins for a busy host.
"""

from __future__ import annotations

import base64
import gzip
import time
import tracemalloc
import zlib
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune import http_client, openai_client
from kvtune.http_client import (
    CredentialConflict,
    LimitExceeded,
    NotJson,
    UnexpectedEncoding,
    credential_conflict,
    shown_url,
    strict_json,
)
from tests.hostile_servers import (
    MIB,
    HostileServer,
    Request,
    endless_body,
    gzip_bomb,
    hostile_server,
    huge_body,
    raw,
    recorded,
    redirect,
    silent,
    slow_loris,
    text,
)

__all__ = ["hostile_server"]  # the fixture, imported for pytest

# Margin for a busy 2-core host on top of a call's worst case (its deadline plus one read timeout).
MARGIN_S = 10.0


def timed_get(server: HostileServer, path: str, **bounds: float) -> tuple[float, BaseException | None]:
    start = time.monotonic()
    with http_client.new_client() as client:
        try:
            http_client.get(client, f"{server.url}{path}", **bounds)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            return time.monotonic() - start, exc
    return time.monotonic() - start, None


def test_a_slow_loris_is_cut_at_the_deadline(hostile_server: HostileServer) -> None:
    # One byte every 0.2 s: every read succeeds well within the read timeout, only the deadline ends it.
    hostile_server.route("/m", slow_loris(interval_s=0.2))
    elapsed, error = timed_get(hostile_server, "/m", deadline_s=1.0)
    assert isinstance(error, LimitExceeded), error
    assert "was still sending after 1 s; the server is stalling" in str(error)
    assert elapsed < 2 * 1.0 + MARGIN_S


def test_a_slow_loris_without_framing_is_cut_at_the_deadline(hostile_server: HostileServer) -> None:
    # No length and no chunks: a client that waits for a full buffer before looking at its clock never looks.
    hostile_server.route("/m", slow_loris(interval_s=0.2, chunked=False))
    elapsed, error = timed_get(hostile_server, "/m", deadline_s=1.0)
    assert isinstance(error, LimitExceeded), error
    assert elapsed < 2 * 1.0 + MARGIN_S


def test_a_body_from_a_mock_transport_is_taken_as_it_is() -> None:
    # httpx.MockTransport answers with a body read already: the policy must not try to stream it again.
    body = b"vllm:num_requests_running 1\n"
    transport = httpx.MockTransport(lambda _request: httpx.Response(200, content=body))
    with httpx.Client(transport=transport) as client:
        assert http_client.get(client, "http://e/metrics").content == body
        with pytest.raises(LimitExceeded):
            http_client.get(client, "http://e/metrics", max_bytes=4)


def test_a_silent_server_waits_no_longer_than_the_deadline(hostile_server: HostileServer) -> None:
    # The client's read timeout is 10 s; a call given 1 s must not wait 10 s for the headers.
    hostile_server.route("/m", silent())
    elapsed, error = timed_get(hostile_server, "/m", deadline_s=1.0)
    assert isinstance(error, httpx.ReadTimeout), error
    assert elapsed < http_client.READ_TIMEOUT_S


def test_an_endless_body_is_cut_at_the_cap(hostile_server: HostileServer) -> None:
    hostile_server.route("/m", endless_body())
    tracemalloc.start()
    try:
        _, error = timed_get(hostile_server, "/m", max_bytes=4 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(error, LimitExceeded), error
    assert "sent more than 4 MiB; not the server expected" in str(error)
    assert peak < 16 * MIB


def test_a_huge_body_with_its_length_is_cut_at_the_cap(hostile_server: HostileServer) -> None:
    hostile_server.route("/m", huge_body(200 * MIB))
    _, error = timed_get(hostile_server, "/m", max_bytes=MIB)
    assert isinstance(error, LimitExceeded) and "more than 1 MiB" in str(error), error


@pytest.mark.parametrize("layers", [1, 2])
def test_a_gzip_bomb_is_cut_before_it_inflates(hostile_server: HostileServer, layers: int) -> None:
    # 1 GiB of zeros in ~1 MiB; twice gzipped, httpx's own decoding would inflate one read to gigabytes.
    hostile_server.route("/m", gzip_bomb(1024 * MIB, layers=layers))
    tracemalloc.start()
    try:
        _, error = timed_get(hostile_server, "/m", max_bytes=4 * MIB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if layers == 1:
        assert isinstance(error, LimitExceeded), error
    else:  # "gzip, gzip" was not asked for
        assert isinstance(error, UnexpectedEncoding) and "'gzip, gzip'" in str(error), error
    assert peak < 16 * MIB


def test_an_encoding_not_asked_for_is_refused(hostile_server: HostileServer) -> None:
    hostile_server.route("/m", raw(b"\x8b\x00\x80hello\x03", headers={"Content-Encoding": "br"}))
    _, error = timed_get(hostile_server, "/m")
    assert isinstance(error, UnexpectedEncoding), error
    assert "Content-Encoding 'br', which kvtune did not ask for (it accepts gzip, deflate)" in str(error)
    assert hostile_server.requests[-1].headers["accept-encoding"] == "gzip, deflate"


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip", gzip.compress),
        ("deflate", zlib.compress),  # zlib-wrapped, as the RFC says
        ("deflate", lambda data: zlib.compress(data)[2:-4]),  # raw deflate, as some servers send
    ],
)
def test_compressed_bodies_are_decoded_whole(
    hostile_server: HostileServer, encoding: str, encode: object
) -> None:
    body = b"vllm:num_requests_running 1\n" * 20_000  # several inflate steps
    assert callable(encode)
    hostile_server.route("/m", raw(encode(body), headers={"Content-Encoding": encoding}))
    with http_client.new_client() as client:
        response = http_client.get(client, f"{hostile_server.url}/m")
    assert response.content == body
    assert "content-encoding" not in response.headers


def test_a_body_that_does_not_inflate_is_refused(hostile_server: HostileServer) -> None:
    hostile_server.route("/m", raw(b"not gzip at all", headers={"Content-Encoding": "gzip"}))
    _, error = timed_get(hostile_server, "/m")
    assert isinstance(error, UnexpectedEncoding) and "does not inflate" in str(error), error


def test_redirects_are_not_followed_and_keys_stay_home(hostile_server: HostileServer) -> None:
    seen: list[Request] = []
    with HostileServer() as elsewhere:
        elsewhere.route("/steal", recorded(text("gotcha"), seen))
        hostile_server.route("/m", redirect(f"{elsewhere.url}/steal"))
        with http_client.new_client({"Authorization": "Bearer secret"}) as client:
            response = http_client.get(client, f"{hostile_server.url}/m")
        # Even a client built to follow them does not, through the policy.
        with httpx.Client(follow_redirects=True, headers={"Authorization": "Bearer secret"}) as client:
            followed = http_client.get(client, f"{hostile_server.url}/m")
    assert response.status_code == followed.status_code == 302
    assert response.headers["location"] == f"{elsewhere.url}/steal"
    assert seen == []


def test_strict_json_refuses_nan_infinity_and_non_json() -> None:
    assert strict_json(httpx.Response(200, content=b'{"a": [1, 2.5, null]}')) == {"a": [1, 2.5, None]}
    for body in (b'{"value": NaN}', b"[Infinity]", b"-Infinity"):
        with pytest.raises(NotJson, match="is not a JSON number"):
            strict_json(httpx.Response(200, content=body))
    for body in (b"<html>", b"\xff\xfe{}", b"", b"[" * 100_000):
        with pytest.raises(NotJson):
            strict_json(httpx.Response(200, content=body))


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:pass@host:8000/x?q=1", "http://user:***@host:8000/x?q=1"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://u@host/", "http://***@host/"),  # a user alone may be a token (https://TOKEN@host)
        ("https://ghp_secret0123456789@host:8443/x", "https://***@host:8443/x"),
        ("http://:pw@host", "http://:***@host"),
        ("http://u:@host/", "http://u:***@host/"),
        ("https://u:p@[::1]:8443/metrics", "https://u:***@[::1]:8443/metrics"),
        ("http://u:p@[fe80::1%25eth0]:80/", "http://u:***@[fe80::1%25eth0]:80/"),
        ("http://u:p@ss@host/", "http://u:***@host/"),  # an @ in the password
        ("http://u:p@host:0", "http://u:***@host:0"),
        ("http://u:secret@host:99999/", "<a URL that cannot be parsed>"),  # port out of range
        ("http://u:secret@host:abc/", "<a URL that cannot be parsed>"),
        ("http://u:secret@[::1/", "<a URL that cannot be parsed>"),
        ("user:secret@host:8000", "user:***@host:8000"),  # no scheme: no authority for urlsplit
        ("http://host/a:b@c", "http://host/a:b@c"),  # an @ in the path is not a password
    ],
)
def test_shown_url_hides_the_password(url: str, shown: str) -> None:
    assert shown_url(url) == shown
    assert "secret" not in shown_url(url)


# ---- one credential per request: a URL's user:password (Basic) or an API key (Bearer), never both ----------

PLANTED = "s3cr3t-Planted"
userinfo = st.tuples(
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12),
    st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=12).map(
        lambda tail: PLANTED + tail
    ),
)


def _with_userinfo(server: HostileServer, user: str, password: str) -> str:
    host = server.url.removeprefix("http://")
    return f"http://{quote(user, safe='')}:{quote(password, safe='')}@{host}/m"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(credentials=userinfo)
def test_a_url_password_beside_a_key_is_refused_before_anything_is_sent(
    hostile_server: HostileServer, credentials: tuple[str, str]
) -> None:
    user, password = credentials
    seen: list[Request] = []
    hostile_server.route("/m", recorded(text("ok"), seen))
    url = _with_userinfo(hostile_server, user, password)
    clients = (http_client.new_client({"Authorization": "Bearer KEY"}), openai_client.client_for("KEY"))
    for client in clients:
        with client, pytest.raises(CredentialConflict) as refused:
            http_client.get(client, url) if client is clients[0] else client.get(url)
        assert PLANTED not in str(refused.value) and quote(PLANTED) not in str(refused.value)
        assert "remove user:password@ from the URL, or give no key" in str(refused.value)
    assert seen == []  # not a byte reached the server
    problem = credential_conflict(url, api_key=True)
    assert problem is not None and PLANTED not in problem
    assert credential_conflict(url, api_key=False) is None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(credentials=userinfo)
def test_either_credential_alone_is_sent_as_given(
    hostile_server: HostileServer, credentials: tuple[str, str]
) -> None:
    user, password = credentials
    seen: list[Request] = []
    hostile_server.route("/m", recorded(text("ok"), seen))
    with http_client.new_client() as client:  # a proxy's Basic auth, from the URL
        http_client.get(client, _with_userinfo(hostile_server, user, password))
    with openai_client.client_for("KEY") as client:  # an engine's key
        client.get(f"{hostile_server.url}/m")
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    assert [request.headers.get("authorization") for request in seen] == [f"Basic {basic}", "Bearer KEY"]
