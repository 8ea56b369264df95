"""One router worker: a router process sharing its port with the other workers (SO_REUSEPORT).

`kvtune up --router-workers N` starts N of these (workers.py). Each serves the router's whole API on the
shared port, where the kernel spreads connections over the workers, and on a port of its own (its
`/metrics` for Prometheus, its `/health` for `kvtune up`). Each keeps its own view of every engine: its own
health watchers, its own prefix LRU (what it routed: its share of the traffic only) and its own KV-event
view, fed by the fan-out (fanout.py) and rebuilt from the engines' replay when it starts.

Its set-up arrives as JSON on stdin (`python -m kvtune.router.worker`): it holds the engines' API key and
a traffic capture's key (capture.py), which must not be on a command line, in an environment or in a file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import sys
from dataclasses import dataclass
from typing import Any

from kvtune.exit_codes import ExitCode
from kvtune.router.capture import CaptureSettings
from kvtune.router.engine_watch import CONNECT_WAIT_S
from kvtune.router.kv_replay import REPLAY_DEADLINE_S
from kvtune.router.proxy_settings import ProxySettings
from kvtune.router.server import RouterOptions, RouterServer, RouterTarget

# A set-up is a few kilobytes (one target per engine); more on stdin is not one.
MAX_SETUP_BYTES = 1 << 20
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSetup:
    index: int
    private_port: int
    options: RouterOptions
    targets: list[RouterTarget]
    settings: ProxySettings
    tokenizer_path: str
    capture: CaptureSettings | None = None

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerSetup:
        raw: dict[str, Any] = json.loads(data)
        return cls(
            index=raw["index"],
            private_port=raw["private_port"],
            options=RouterOptions(**raw["options"] | {"worker_ports": tuple(raw["options"]["worker_ports"])}),
            targets=[RouterTarget(**target) for target in raw["targets"]],
            settings=ProxySettings(**raw["settings"]),
            tokenizer_path=raw["tokenizer_path"],
            capture=CaptureSettings(**raw["capture"]) if raw.get("capture") else None,
        )


def bound_socket(host: str, port: int, shared: bool) -> socket.socket:
    """A TCP socket bound to HOST:PORT (it listens once the server starts: until then the kernel sends
    this worker no connection); SHARED: with SO_REUSEPORT, so every worker binds the same port and the
    kernel balances new connections across the ones listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if shared:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(process)d %(levelname)s %(message)s")
    try:
        setup = WorkerSetup.decode(sys.stdin.buffer.read(MAX_SETUP_BYTES))
    except (ValueError, KeyError, TypeError) as exc:
        log.error("a router worker's set-up on stdin is not readable (%s)", exc)
        return ExitCode.CONFIG
    host = setup.options.host
    try:
        sockets = [
            bound_socket(host, setup.options.port, shared=True),
            bound_socket(host, setup.private_port, shared=False),
        ]
    except OSError as exc:
        log.error("router worker %d: cannot listen on %s: %s", setup.index, host, exc)
        return ExitCode.CONFIG
    server = RouterServer(
        setup.options, setup.targets, setup.settings, setup.tokenizer_path,
        capture=setup.capture, worker=setup.index,
    )  # fmt: skip
    log.info(
        "router worker %d: %s policy on %s:%d (own port %d)",
        setup.index, setup.options.policy, host, setup.options.port, setup.private_port,
    )  # fmt: skip
    if setup.options.policy == "prefix":
        log.info(
            "router worker %d: the prefix policy starts empty: it knows only what it routes", setup.index
        )
    # Before listening: each engine read once and each KV-event view rebuilt from its replay.
    settle_s = 3 * setup.options.health_period_s + CONNECT_WAIT_S + REPLAY_DEADLINE_S
    server.serve(sockets, settle_s)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
