"""A tiny loopback HTTP server that answers as a test scripts it and records what it was sent: the stand-in
for a server that is not vLLM (a web site, an API without /metrics, a recording proxy)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None


Answer = Callable[["Handler"], None]


class Server(ThreadingHTTPServer):
    def __init__(self, answer: Answer) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.answer = answer
        self.seen: list[Seen] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def _handle(self) -> None:
        self.server.seen.append(Seen(self.command, self.path, self.headers.get("Authorization")))
        self.server.answer(self)

    def reply(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serving(answer: Answer) -> Iterator[Server]:
    server = Server(answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def html_404(handler: Handler) -> None:
    handler.reply(404, "text/html", b"<html><body>Not Found</body></html>")


def html_200(handler: Handler) -> None:
    handler.reply(200, "text/html", b"<html><body>Welcome to a web site</body></html>")
