"""The controller's HTTP API on 127.0.0.1: what each engine is doing, where it listens, what KV it has."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException

from kvtune.supervisor import State, Supervisor


def create_app(supervisor: Supervisor) -> FastAPI:
    app = FastAPI(title="kvtune controller", description="Status of the vLLM engines kvtune supervises.")
    app.state.supervisor = supervisor

    @app.get("/health")
    def health() -> dict[str, Any]:
        states = [status.state for status in supervisor.statuses()]
        return {"ok": all(state == State.READY for state in states), "engines": len(states)}

    @app.get("/engines")
    def engines() -> list[dict[str, Any]]:
        return [status.as_dict() for status in supervisor.statuses()]

    @app.get("/engines/{name}")
    def engine(name: str) -> dict[str, Any]:
        for status in supervisor.statuses():
            if status.name == name:
                return status.as_dict()
        raise HTTPException(status_code=404, detail=f"no engine named {name!r}")

    return app


class ControlServer:
    """uvicorn in a background thread: the main thread keeps the signals (uvicorn only takes them there)."""

    def __init__(self, supervisor: Supervisor, host: str, port: int) -> None:
        config = uvicorn.Config(create_app(supervisor), host=host, port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name="control-api", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
