"""A total deadline for reading a request's body, for the HTTP servers kvtune runs (router, control API).

uvicorn times out an idle keep-alive connection, but not a request whose body trickles in: a client that
declares 8 MB and sends a byte a second holds its connection, the app's task and the bytes so far for as
long as it likes, and a few hundred such clients hold a router worker. This ASGI middleware gives every
receive of the body the time left until SECONDS after the request arrived; past it the app's read raises
(BodyDeadlineExceeded), whatever the app answers instead is dropped, and the client gets 408 with
`Connection: close`, so uvicorn drops the connection and the rest of the body with it. An answer given
before the body was read in full (a 401, a 404, a GET that takes none) closes the connection too: uvicorn
would otherwise read the rest of it, at the client's pace, to keep the connection alive.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# The router's bodies are up to its body limit (8 MB for an 8K-token model, more for longer contexts): a
# minute is ~140 KB/s for the default, far below any client on a network that can use a model server.
ROUTER_BODY_DEADLINE_S = 60.0
# The control API takes no body worth the name.
CONTROL_BODY_DEADLINE_S = 10.0

# The 408's body, given the message: JSON the server's clients read (an OpenAI error for the router).
Answer = Callable[[str], dict[str, object]]


class BodyDeadlineExceeded(Exception):
    """The body did not arrive in full within the deadline (raised into the app's read of it)."""


def _detail(message: str) -> dict[str, object]:
    return {"detail": message}


@dataclass
class _Exchange:
    body_done: bool = False
    expired: bool = False
    started: bool = False


class BodyDeadline:
    """ASGI middleware: a request's body within SECONDS of its arrival, or 408 (ANSWER shapes its JSON)."""

    def __init__(self, app: ASGIApp, seconds: float, answer: Answer = _detail) -> None:
        self.app = app
        self.seconds = seconds
        self.answer = answer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.seconds
        exchange = _Exchange(body_done=not _has_body(scope))

        async def timed_receive() -> Message:
            if exchange.body_done:  # after the body: a wait for the client to go away, unbounded by design
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
            except TimeoutError:
                exchange.expired = True
                raise BodyDeadlineExceeded(
                    f"the request body did not arrive within {self.seconds:g} s"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                exchange.body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            if exchange.expired:
                return  # the 408 below answers in its place
            if message["type"] == "http.response.start":
                exchange.started = True
                if not exchange.body_done:  # the rest of the body is not waited for
                    message = {**message, "headers": [*_without_connection(message), CLOSE]}
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not exchange.expired or exchange.started:
                raise
        if exchange.expired and not exchange.started:
            await _send_408(send, self.answer(self._message()))

    def _message(self) -> str:
        return (
            f"the request body did not arrive within {self.seconds:g} s; send it at once (a client that "
            "trickles its body is cut off)"
        )


CLOSE = (b"connection", b"close")


def _has_body(scope: Scope) -> bool:
    """Whether the request's headers announce a body (a length above 0, or chunks)."""
    for name, value in scope.get("headers", []):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b"0 ") != b""):
            return True
    return False


def _without_connection(message: Message) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in message.get("headers", []) if name.lower() != b"connection"]


async def _send_408(send: Send, payload: dict[str, object]) -> None:
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 408,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                CLOSE,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
