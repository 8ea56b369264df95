"""Every router worker hears every engine's KV events: one ZeroMQ proxy (XSUB -> XPUB) per engine.

An engine publishes its events to one address (its profile's kv_events_port), where only one socket can
bind. With several router workers, that socket is the XSUB side of a proxy run by `kvtune up`; the proxy
passes each batch, unchanged (topic, sequence, payload), to every worker subscribed to its XPUB side, an
IPC socket in a folder only this user can open. ZeroMQ's own proxy does the forwarding (zmq.proxy_steerable,
stopped through its control socket); nothing here reads the events. A worker that falls behind past the
high-water mark loses batches, which its follower sees as a sequence gap (a resync), like any loss.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import zmq

from kvtune.router.engine_watch import MAX_KV_MESSAGE_BYTES

# Batches queued per subscriber before the proxy drops (vLLM's own publisher uses the same mark).
HIGH_WATER_MARK = 100_000


class KvEventFanout:
    """For each engine (name -> the endpoint its events arrive at): a proxy to an IPC endpoint workers
    subscribe to (`subscribe_endpoints`), running from `start` to `stop`."""

    def __init__(self, engines: Mapping[str, str]) -> None:
        self.engines = dict(engines)
        self._folder: Path | None = None
        self._context = zmq.Context()
        self._controls: list[zmq.Socket[bytes]] = []
        self._threads: list[threading.Thread] = []
        self.subscribe_endpoints: dict[str, str] = {}

    def start(self) -> None:
        """Bind every engine's endpoint and its fan-out; OSError/ZMQError (the fan-out stopped again)
        when one cannot be bound."""
        self._folder = Path(tempfile.mkdtemp(prefix="kvtune-kv-events-"))  # mode 0700
        try:
            for index, (name, endpoint) in enumerate(self.engines.items()):
                fanned = f"ipc://{self._folder / f'engine-{index}.sock'}"
                self._start_proxy(index, endpoint, fanned)
                self.subscribe_endpoints[name] = fanned
        except BaseException:
            self.stop()
            raise

    def _start_proxy(self, index: int, endpoint: str, fanned: str) -> None:
        frontend = self._context.socket(zmq.XSUB)
        backend = self._context.socket(zmq.XPUB)
        control = self._context.socket(zmq.PAIR)
        steer = self._context.socket(zmq.PAIR)
        for socket in (frontend, backend, control, steer):
            socket.setsockopt(zmq.LINGER, 0)
        frontend.setsockopt(zmq.MAXMSGSIZE, MAX_KV_MESSAGE_BYTES)
        frontend.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        backend.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        address = f"inproc://kvtune-fanout-{index}"
        try:
            frontend.bind(endpoint)
            backend.bind(fanned)
            control.bind(address)
            steer.connect(address)
        except zmq.ZMQError:
            for socket in (frontend, backend, control, steer):
                socket.close()
            raise

        def run() -> None:
            try:
                zmq.proxy_steerable(frontend, backend, None, control)
            except zmq.ZMQError:  # the context was terminated under it
                pass
            finally:
                for socket in (frontend, backend, control):
                    socket.close()

        thread = threading.Thread(target=run, name=f"kv-events-fanout-{index}", daemon=True)
        thread.start()
        self._controls.append(steer)
        self._threads.append(thread)

    def stop(self) -> None:
        for steer in self._controls:
            with contextlib.suppress(zmq.ZMQError):
                steer.send(b"TERMINATE")
        for thread in self._threads:
            thread.join(timeout=5)
        for steer in self._controls:
            steer.close()
        self._controls.clear()
        self._threads.clear()
        self.subscribe_endpoints.clear()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
