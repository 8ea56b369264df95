"""One vLLM OpenAI server process: started in its own session, polled until ready, stopped as a group.

`Engine` is a context manager (for tests and the sweep) and the unit the supervisor restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import httpx

from kvtune import processes
from kvtune.config_errors import ConfigError
from kvtune.files import child_path
from kvtune.openai_client import auth_headers
from kvtune.platform import bound_cores
from kvtune.processes import group_members as group_members  # callers that import it from here
from kvtune.profile import EngineProfile

log = logging.getLogger(__name__)

START_MARKER = "==== kvtune: starting"
_EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(Error|Exception|Exit): .*")
_GENERIC_FAILURES = ("initialization failed", "See root cause above", "check the stack trace")


def _with_detail(cause: str, following: list[str]) -> str:
    """A pydantic error names only its model ("1 validation error for SchedulerConfig"); the message
    that says what to change is on the next line."""
    if "validation error" not in cause or not following:
        return cause
    detail = following[0].strip().removeprefix("Value error, ").split(" [type=")[0]
    return f"{cause}: {detail}"


def serves_model(client: httpx.Client, name: str | None = None) -> bool:
    """The server CLIENT reaches is ready: /health answers 200 and /v1/models lists NAME (any model when
    None). A refused connection or a body that is no JSON is "not yet"."""
    try:
        if client.get("/health").status_code != 200:
            return False
        models = client.get("/v1/models").json().get("data", [])
    except (httpx.HTTPError, ValueError):
        return False
    return any(name is None or entry.get("id") == name for entry in models)


class EngineError(RuntimeError):
    """An engine that could not start or stopped unexpectedly; str() says why."""


class PortInUseError(EngineError):
    pass


def port_in_use(host: str, port: int) -> bool:
    """True when a server could not bind host:port (same SO_REUSEADDR setting uvicorn uses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it), for engines and Locust masters."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int, owner: str) -> None:
    if port_in_use(host, port):
        raise PortInUseError(
            f"{owner}: port {port} on {host} is already in use; stop what listens there "
            f"(e.g. `ss -ltnp 'sport = :{port}'`) or choose another port"
        )


def log_file(folder: Path, profile: EngineProfile) -> Path:
    """The engine's log in `folder`, named after it; ConfigError when a link there leads outside."""
    try:
        return child_path(folder, f"{profile.name}.log")
    except ValueError as exc:
        raise ConfigError(
            f"engine {profile.name!r}: its log {exc}; remove the link or use another --log-dir"
        ) from None


def failure_reason(path: Path) -> str:
    """The root cause of an engine's exit, from its log's latest run.

    vLLM's last lines are generic ("Engine core initialization failed. See root cause above."), so the
    reason is the last exception line that is not one of those; else the last log line.
    """
    text = path.read_text(errors="replace") if path.is_file() else ""
    run = text.rsplit(START_MARKER, 1)[-1].splitlines()
    causes = [
        _with_detail(match.group(0).strip(), run[index + 1 : index + 2])
        for index, line in enumerate(run)
        if (match := _EXCEPTION_LINE.search(line)) and not any(g in line for g in _GENERIC_FAILURES)
    ]
    if causes:
        return causes[-1]
    return run[-1].strip() if run else "no log output"


class Engine:
    """A vLLM server for one profile. `with Engine(profile, log_path) as engine:` waits until it serves."""

    def __init__(
        self,
        profile: EngineProfile,
        log_path: Path,
        *,
        model_path: str | None = None,
        ready_timeout: float | None = None,
        stop_grace: float | None = None,
        extra_env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        """`ready_timeout` (seconds) overrides the profile's `ready_timeout_s`; `command` replaces the
        profile's vLLM command line (fault-injection tests start fakes)."""
        self.profile = profile
        self.log_path = log_path
        self.model_path = model_path
        self._timeout_from_profile = ready_timeout is None
        self.ready_timeout = profile.ready_timeout_s if ready_timeout is None else ready_timeout
        # Past the engine's own drain time (vLLM --shutdown-timeout), a stop turns into SIGKILL.
        self.stop_grace = profile.shutdown_timeout + 10.0 if stop_grace is None else stop_grace
        self.extra_env = extra_env or {}
        self.command = command
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_handle: IO[bytes] | None = None
        # The supervisor's watcher thread and a shutdown signal may both stop the same engine.
        self._stop_lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.profile.url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def returncode(self) -> int | None:
        """None while running (or never started); the exit code once the server process has ended."""
        return self._proc.poll() if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        check_port_free(self.profile.host, self.profile.port, f"engine {self.profile.name!r}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_handle = self.log_path.open("ab")
        argv = self.command or self.profile.argv(self.model_path)
        self._log_handle.write(f"\n{START_MARKER} {' '.join(argv)}\n".encode())
        self._log_handle.flush()
        # Credentials (secret_env, the API key) reach the engine through its environment, never its argv.
        env = os.environ | self.profile.launch_env() | self.extra_env
        # Own session: vLLM forks an engine core and workers; stopping the group reaches all of them.
        self._proc = subprocess.Popen(
            argv, stdout=self._log_handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._pin_to_bound_cores(self._proc.pid)
        log.info("engine %s: started pid %d, log %s", self.profile.name, self._proc.pid, self.log_path)

    def _pin_to_bound_cores(self, pid: int) -> None:
        """Keep a CPU engine's every process on the cores its compute threads are bound to.

        vLLM's CPU build binds only its worker's OpenMP threads; its API server and engine core float, and
        the engine core busy-waits on the worker (measured: 75-87% of a core while the worker computes). On
        a core another engine computes on, that wait takes the other engine's cycles, so replicas given a
        core each would not be a core each. Set as soon as the process exists: Popen returns once exec has
        succeeded, before the interpreter starts a thread or vLLM its engine core, which inherit it."""
        cores = bound_cores(self.profile.cpu_threads_bind) if self.profile.device == "cpu" else None
        if not cores:
            return
        try:
            os.sched_setaffinity(pid, cores)
        except OSError as exc:  # the compute threads stay bound by vLLM; only the rest may float
            log.warning("engine %s: could not keep it on cores %s: %s", self.profile.name, sorted(cores), exc)

    def wait_ready(self, timeout: float | None = None, cancel: threading.Event | None = None) -> None:
        """Poll /health, then /v1/models for the served name; fail fast if the process died."""
        limit = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with httpx.Client(
            base_url=self.url, timeout=5.0, headers=auth_headers(self.profile.api_key())
        ) as client:
            while time.monotonic() < deadline:
                if cancel is not None and cancel.is_set():
                    raise EngineError(f"engine {self.profile.name!r}: start-up cancelled")
                code = self.returncode()
                if code is not None:
                    raise EngineError(
                        f"engine {self.profile.name!r} exited with code {code} before it was ready: "
                        f"{failure_reason(self.log_path)} (log: {self.log_path})"
                    )
                if self._serves_model(client):
                    return
                time.sleep(0.5)
        if self._timeout_from_profile and timeout is None:
            fix = "raise ready_timeout_s in the profile"
        else:
            fix = "raise the timeout given in place of the profile's ready_timeout_s"
        raise EngineError(
            f"engine {self.profile.name!r} not ready after {limit:.0f} s; {fix} "
            f"(last log line: {failure_reason(self.log_path)}; log: {self.log_path})"
        )

    def _serves_model(self, client: httpx.Client) -> bool:
        return serves_model(client, self.profile.api_model_name)

    def stop(self) -> int | None:
        """SIGTERM the server, wait the grace period for its whole group to end, then SIGKILL what is left."""
        with self._stop_lock:
            return self._stop_locked()

    def _stop_locked(self) -> int | None:
        proc = self._proc
        if proc is None:
            return None
        # SIGTERM to the API server alone: it drains requests in flight (--shutdown-timeout), then stops
        # its engine core. Signalling the whole group would abort the core mid-request.
        grace = self.stop_grace
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
        else:  # the server died (crash, kill -9): nobody drains, its orphans get the signal directly
            processes.signal_group(proc.pid, signal.SIGTERM)  # session leader: its pid is the group id
            grace = min(grace, 5.0)
        code = processes.reap_group(proc, grace, f"engine {self.profile.name}")
        if self._log_handle:
            self._log_handle.close()
            self._log_handle = None
        log.info("engine %s: stopped (exit code %s)", self.profile.name, code)
        return code

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
