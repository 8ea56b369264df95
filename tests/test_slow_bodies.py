"""Clients that send their request body a byte at a time, against the servers kvtune runs on 127.0.0.1.

The router gets the whole body within its deadline (RouterOptions.body_deadline_s, 1 s here) or answers
408 and drops the connection, while its other requests are served; an answer given before the body was
read (a 401, the control API's GETs) closes the connection at once rather than wait for the rest. Each
slow client is a raw socket sending one byte every 0.1 s, for as long as the server keeps it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtune import metrics
from kvtune.control_api import ControlServer
from kvtune.engine import Engine, free_port
from kvtune.profile import EngineProfile
from kvtune.supervisor import Supervisor
from tests.test_router_hostile import MODEL, FleetFactory

DEADLINE_S = 1.0
BYTE_EVERY_S = 0.1
# A busy 2-core host: what must end within the deadline ends well within this.
MARGIN_S = 10.0
# The client's own bound: a server that never answers fails the test here, not never.
GIVE_UP_S = DEADLINE_S + 3 * MARGIN_S


@dataclass
class Trickled:
    """What a slow client saw: the server's answer, when its first byte came, and whether it hung up."""

    answer: bytes
    answered_after_s: float | None
    closed_after_s: float | None

    @property
    def status(self) -> int:
        return int(self.answer.split(b" ", 2)[1])

    @property
    def body(self) -> bytes:
        return self.answer.split(b"\r\n\r\n", 1)[1]


def trickle(port: int, head: str, *, chunked: bool = False) -> Trickled:
    """Send HEAD, then the body a byte every BYTE_EVERY_S (a chunk of one byte each, when CHUNKED) until the
    server hangs up or GIVE_UP_S passes."""
    started = time.monotonic()
    answer = b""
    answered = closed = None
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.settimeout(BYTE_EVERY_S)
        client.sendall(head.encode())
        while time.monotonic() - started < GIVE_UP_S:
            try:
                client.sendall(b"1\r\na\r\n" if chunked else b"a")
                received = client.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset: the server closed with the client's bytes unread
                received = b""
            now = time.monotonic() - started
            if not received:
                closed = now
                break
            answer += received
            answered = now if answered is None else answered
    return Trickled(answer, answered, closed)


def post_head(path: str, *, chunked: bool, headers: str = "") -> str:
    framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 100000"
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}{framing}\r\n\r\n"


@pytest.fixture
def make_fleet() -> Iterator[FleetFactory]:
    factory = FleetFactory()
    yield factory
    factory.stop()


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_a_trickled_body_gets_408_at_the_deadline_and_others_are_served_meanwhile(
    make_fleet: FleetFactory, chunked: bool
) -> None:
    fleet = make_fleet(body_deadline_s=DEADLINE_S)
    port = int(fleet.router.url.rsplit(":", 1)[1])
    outcome: list[Trickled] = []
    slow = threading.Thread(
        target=lambda: outcome.append(trickle(port, post_head("/v1/completions", chunked=chunked)))
    )
    slow.start()
    time.sleep(BYTE_EVERY_S * 3)
    # The slow client holds its request, not the router: another is answered before the 408 comes.
    assert fleet.complete("hello").status_code == 200
    served_while_slow = not outcome
    slow.join(GIVE_UP_S + 5)
    (seen,) = outcome
    assert served_while_slow
    assert seen.status == 408, seen.answer[:300]
    assert json.loads(seen.body)["error"]["code"] == "request_timeout"
    assert seen.answered_after_s is not None and DEADLINE_S <= seen.answered_after_s < DEADLINE_S + MARGIN_S
    assert seen.closed_after_s is not None and seen.closed_after_s < DEADLINE_S + MARGIN_S
    assert fleet.metric(metrics.ROUTER_REFUSED, reason="slow_body") == 1
    assert len(fleet.engine.posts) == 1, "only the prompt request reached the engine"


def test_a_body_sent_in_time_is_unaffected_and_a_refusal_before_it_closes_the_connection(
    make_fleet: FleetFactory,
) -> None:
    fleet = make_fleet(api_key="router-key", body_deadline_s=DEADLINE_S)
    port = int(fleet.router.url.rsplit(":", 1)[1])
    # Refused for its key before its body is read: answered at once, and not held for the rest.
    seen = trickle(port, post_head("/v1/completions", chunked=False))
    assert seen.status == 401
    assert seen.closed_after_s is not None and seen.closed_after_s < MARGIN_S
    assert seen.closed_after_s < DEADLINE_S + 1, "closed on the answer, not at the deadline"
    body = {"model": MODEL, "prompt": "hello"}
    answer = fleet.client.post("/v1/completions", json=body, headers={"Authorization": "Bearer router-key"})
    assert answer.status_code == 200


@pytest.fixture
def control(tmp_path: Path) -> Iterator[int]:
    profile = EngineProfile.model_validate({"name": "e1", "device": "cpu", "model": "fake-model"})
    port = free_port()
    server = ControlServer(Supervisor([Engine(profile, tmp_path / "e1.log")]), "127.0.0.1", port)
    server.start()
    deadline = time.monotonic() + 30
    while not server.server.started:
        assert time.monotonic() < deadline, "the control API did not start"
        time.sleep(0.02)
    yield port
    server.stop()


@pytest.mark.parametrize(("method", "path", "status"), [("GET", "/health", 200), ("POST", "/engines", 405)])
def test_the_control_api_answers_a_trickled_request_and_hangs_up(
    control: int, method: str, path: str, status: int
) -> None:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
    seen = trickle(control, head)
    assert seen.status == status
    assert seen.closed_after_s is not None and seen.closed_after_s < MARGIN_S
