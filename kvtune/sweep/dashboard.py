"""A sweep's study, live in optuna-dashboard (the PyPI package) on 127.0.0.1 while the sweep runs.

optuna-dashboard is a WSGI app over any Optuna storage; kvtune serves it from a thread of the sweep's own
process with the standard library's WSGI server (optuna-dashboard's `run_server` does the same, but blocks
and binds where it is told), so it starts and stops with the sweep. Each measured config is a trial whose
user attributes carry its goodput, SLO verdict, hit rate, preemptions, peak KV usage, config and worker
(kvtune.sweep.study.dashboard_attrs).

optuna-dashboard's API writes as readily as it reads (`DELETE /api/studies/<id>` deletes the study every
worker shares) and asks nobody who they are: any local user or process, or a web page whose script reaches
127.0.0.1, could use it. So kvtune serves it read-only: a WSGI layer in front refuses every method but GET
and HEAD (405), and every request whose Host is not this address (a page of another site resolving its own
name to 127.0.0.1, DNS rebinding, is refused with 403). `--dashboard-writable` lets the writes through.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna_dashboard  # type: ignore[import-untyped]  # no type information shipped
from optuna.storages import BaseStorage

from kvtune.config_errors import ConfigError

log = logging.getLogger(__name__)
HOST = "127.0.0.1"  # the dashboard shows the study to whoever reaches it: loopback only
# The methods that only read: optuna-dashboard changes nothing on GET (its writes are POST, PUT and DELETE).
READ_METHODS = frozenset({"GET", "HEAD"})
# What optuna-dashboard lets a caller change, as `--dashboard-writable` says it.
WRITES = (
    "delete, rename or create studies, tell trials, write notes and attributes, upload or delete artifacts"
)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def access_note(writable: bool) -> str:
    """What the dashboard lets a visitor do, for the line that announces it."""
    if writable:
        return f"WRITABLE: anyone who reaches it can {WRITES} (--dashboard-writable)"
    return "read-only: requests that would change the study are refused; --dashboard-writable opens them"


def _guarded(app: WsgiApp, port: int, *, writable: bool) -> WsgiApp:
    """APP answering requests addressed to 127.0.0.1:PORT (403 otherwise) and, unless WRITABLE, only those
    that read: GET and HEAD (405 otherwise, before optuna-dashboard sees them)."""
    hosts = {f"{HOST}:{port}", f"localhost:{port}"}

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if str(environ.get("HTTP_HOST", "")).lower() not in hosts:
            return _refuse(start_response, "403 Forbidden", f"address the dashboard as http://{HOST}:{port}/")
        method = str(environ.get("REQUEST_METHOD", "")).upper()
        if not writable and method not in READ_METHODS:
            return _refuse(
                start_response,
                "405 Method Not Allowed",
                "kvtune serves this dashboard read-only; restart the sweep with --dashboard-writable to "
                "change the study from it",
                [("Allow", ", ".join(sorted(READ_METHODS)))],
            )
        return app(environ, start_response)

    return guarded


def _refuse(
    start_response: Callable[..., Any], status: str, reason: str, extra: list[tuple[str, str]] | None = None
) -> list[bytes]:
    body = f"{status}: {reason}\n".encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    start_response(status, headers + (extra or []))
    return [body]


def _unset_app(_environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    return _refuse(start_response, "503 Service Unavailable", "starting")


class _QuietHandler(WSGIRequestHandler):
    """Requests logged at debug level, not printed over the sweep's progress."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("dashboard: " + format, *args)


@contextmanager
def serving(storage: BaseStorage, port: int, *, writable: bool = False) -> Iterator[str]:
    """optuna-dashboard over STORAGE on 127.0.0.1:PORT (0: any free port) until the block ends, read-only
    unless WRITABLE; yields its address. ConfigError naming --dashboard when the port is taken."""
    try:
        server: WSGIServer = make_server(HOST, port, _unset_app, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(
            f"--dashboard {port}: cannot listen on {HOST}:{port}: {exc.strerror}; pick another port"
        ) from None
    # Guarded by the port bound (PORT 0 picks one), before any request is served.
    server.set_app(_guarded(optuna_dashboard.wsgi(storage), server.server_port, writable=writable))
    thread = threading.Thread(target=server.serve_forever, name="optuna-dashboard", daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_port}/dashboard/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
