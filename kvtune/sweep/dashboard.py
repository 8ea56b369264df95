"""A sweep's study, live in optuna-dashboard (the PyPI package) on 127.0.0.1 while the sweep runs.

optuna-dashboard is a WSGI app over any Optuna storage; kvtune serves it from a thread of the sweep's own
process with the standard library's WSGI server (optuna-dashboard's `run_server` does the same, but blocks
and binds where it is told), so it starts and stops with the sweep. Each measured config is a trial whose
user attributes carry its goodput, SLO verdict, hit rate, preemptions, peak KV usage, config and worker
(kvtune.sweep.study.dashboard_attrs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna_dashboard  # type: ignore[import-untyped]  # no type information shipped
from optuna.storages import BaseStorage

from kvtune.config_errors import ConfigError

log = logging.getLogger(__name__)
HOST = "127.0.0.1"  # the dashboard shows the study to whoever reaches it: loopback only


class _QuietHandler(WSGIRequestHandler):
    """Requests logged at debug level, not printed over the sweep's progress."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("dashboard: " + format, *args)


@contextmanager
def serving(storage: BaseStorage, port: int) -> Iterator[str]:
    """optuna-dashboard over STORAGE on 127.0.0.1:PORT (0: any free port) until the block ends; yields its
    address. ConfigError naming --dashboard when the port is taken."""
    try:
        server: WSGIServer = make_server(
            HOST, port, optuna_dashboard.wsgi(storage), handler_class=_QuietHandler
        )
    except OSError as exc:
        raise ConfigError(
            f"--dashboard {port}: cannot listen on {HOST}:{port}: {exc.strerror}; pick another port"
        ) from None
    thread = threading.Thread(target=server.serve_forever, name="optuna-dashboard", daemon=True)
    thread.start()
    try:
        yield f"http://{HOST}:{server.server_port}/dashboard/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
