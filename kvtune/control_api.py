"""The controller's HTTP API on 127.0.0.1: what each engine is doing, where it listens, what KV it has."""

from __future__ import annotations

import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from kvtune.supervisor import EngineStatus, State, Supervisor


class Health(BaseModel):
    """Whether every engine serves."""

    ok: bool = Field(description="true when every engine is ready (also when there are none)")
    engines: int = Field(ge=0, description="how many engines this controller supervises")


class NotFound(BaseModel):
    detail: str = Field(description="which engine name was not found")


def create_app(supervisor: Supervisor) -> FastAPI:
    """The API; its OpenAPI schema documents each answer from the supervisor's own `EngineStatus`."""
    app = FastAPI(title="kvtune controller", description="Status of the vLLM engines kvtune supervises.")
    app.state.supervisor = supervisor

    @app.get("/health", response_model=Health)
    def health() -> Health:
        """Whether every supervised engine is ready."""
        states = [status.state for status in supervisor.statuses()]
        return Health(ok=all(state == State.READY for state in states), engines=len(states))

    # Each answer is the dict the supervisor builds (it leaves secrets out); the model documents it.
    @app.get("/engines", response_model=list[EngineStatus])
    def engines() -> list[dict[str, Any]]:
        """Every engine: state, pid, url, restarts, last failure, real KV capacity, warm-up, profile."""
        return [status.as_dict() for status in supervisor.statuses()]

    @app.get("/engines/{name}", response_model=EngineStatus, responses={404: {"model": NotFound}})
    def engine(name: str) -> dict[str, Any]:
        """One engine by its profile name."""
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
