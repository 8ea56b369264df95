"""The controller's HTTP API on 127.0.0.1: what each engine is doing, where it listens, what KV it has.

The engines' status tells where they listen and how they were started: when the profiles set an API key,
/engines asks for one of those keys (`Authorization: Bearer <key>`), as the engines themselves do. Bound
beyond loopback, it must have a key to ask for: `check_exposure` refuses the address otherwise.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field

from kvtune.body_deadline import CONTROL_BODY_DEADLINE_S, BodyDeadline
from kvtune.config_errors import ConfigError
from kvtune.profile import is_loopback
from kvtune.supervisor import EngineStatus, State, Supervisor


class Health(BaseModel):
    """Whether every engine serves."""

    ok: bool = Field(description="true when every engine is ready (also when there are none)")
    engines: int = Field(ge=0, description="how many engines this controller supervises")


class NotFound(BaseModel):
    detail: str = Field(description="which engine name was not found")


# Module-level: FastAPI resolves the dependency's annotation (a string, with postponed annotations) here.
_BEARER = HTTPBearer(auto_error=False, description="one of the supervised engines' API keys")
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]


class RouterWorkerStatus(BaseModel):
    """One router worker as the control API shows it."""

    index: int = Field(ge=0, description="the worker's number, its `worker` label in Prometheus")
    pid: int | None = Field(description="its process id; null while it waits to be started again")
    url: str = Field(description="its own address: /metrics and /health of this worker alone")
    restarts: int = Field(ge=0, description="times it was started again after it exited")
    alive: bool = Field(description="its process is running")
    log_path: str


class Unauthorized(BaseModel):
    detail: str = Field(description="why the request was refused: no key, or not one of the engines' keys")


def check_exposure(host: str, api_keys: Sequence[str]) -> None:
    """ConfigError when the API would answer anyone on a network: a non-loopback address and no key."""
    if not is_loopback(host) and not api_keys:
        raise ConfigError(
            f"--control-host {host}: the control API would show every engine's status to anyone who can "
            "reach that address, with no key to ask for; keep 127.0.0.1, or set api_key_env (or "
            "api_key_file) in the profiles: the API then asks for that key"
        )


def create_app(supervisor: Supervisor, api_keys: Sequence[str] = ()) -> FastAPI:
    """The API; its OpenAPI schema documents each answer from the supervisor's own `EngineStatus`.

    With `api_keys`, the engine routes answer only a request bearing one of them; /health stays open
    (a liveness probe carries no key, and it tells only whether all engines serve).
    """
    app = FastAPI(title="kvtune controller", description="Status of the vLLM engines kvtune supervises.")
    app.add_middleware(BodyDeadline, seconds=CONTROL_BODY_DEADLINE_S)  # no client holds it by trickling
    app.state.supervisor = supervisor
    keys = [key.encode() for key in api_keys]

    def authorized(credentials: BearerCredentials) -> None:
        given = credentials.credentials.encode() if credentials else b""
        # Every key is compared, in constant time: the answer's timing says nothing about which one matched.
        matched = [secrets.compare_digest(given, key) for key in keys]
        if not any(matched):
            raise HTTPException(
                status_code=401,
                detail="send one of the engines' API keys as 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )

    # Declared only when enforced: the schema then says truthfully which routes need a key.
    needs_key = [Depends(authorized)] if keys else []
    refusals: dict[int | str, dict[str, Any]] = {401: {"model": Unauthorized}} if keys else {}

    @app.get("/health", response_model=Health)
    def health() -> Health:
        """Whether every supervised engine is ready."""
        states = [status.state for status in supervisor.statuses()]
        return Health(ok=all(state == State.READY for state in states), engines=len(states))

    # Each answer is the dict the supervisor builds (it leaves secrets out); the model documents it.
    @app.get(
        "/engines",
        response_model=list[EngineStatus],
        dependencies=needs_key,
        responses=refusals,
    )
    def engines() -> list[dict[str, Any]]:
        """Every engine: state, pid, url, restarts, last failure, real KV capacity, warm-up, profile."""
        return [status.as_dict() for status in supervisor.statuses()]

    @app.get(
        "/engines/{name}",
        response_model=EngineStatus,
        dependencies=needs_key,
        responses={404: {"model": NotFound}, **refusals},
    )
    def engine(name: str) -> dict[str, Any]:
        """One engine by its profile name."""
        for status in supervisor.statuses():
            if status.name == name:
                return status.as_dict()
        raise HTTPException(status_code=404, detail=f"no engine named {name!r}")

    @app.get(
        "/router/workers",
        response_model=list[RouterWorkerStatus],
        dependencies=needs_key,
        responses=refusals,
    )
    def router_workers() -> list[RouterWorkerStatus]:
        """The router's worker processes (`--router-workers N`): pid, own port, restarts; empty when the
        router runs inside kvtune or there is none."""
        shown: Callable[[], list[RouterWorkerStatus]] | None = app.state.router_workers
        return shown() if shown is not None else []

    app.state.router_workers = None
    return app


class ControlServer:
    """uvicorn in a background thread: the main thread keeps the signals (uvicorn only takes them there)."""

    def __init__(self, supervisor: Supervisor, host: str, port: int, api_keys: Sequence[str] = ()) -> None:
        check_exposure(host, api_keys)
        self.app = create_app(supervisor, api_keys)
        config = uvicorn.Config(self.app, host=host, port=port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.url = f"http://{host}:{port}"
        self._thread = threading.Thread(target=self.server.run, name="control-api", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def show_router_workers(self, statuses: Callable[[], list[RouterWorkerStatus]]) -> None:
        self.app.state.router_workers = statuses

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
