"""A throwaway PostgreSQL server for tests: Debian's `postgresql` binaries, its data in a temp folder, bound
to 127.0.0.1 on a free port, stopped (by pg_ctl, then by its PID) when the test ends.

PostgreSQL refuses to run as root: as root (CI), the server runs as the `postgres` user the Debian package
creates. The test database is `sweeps`, its user `kvtune` with a password, so clients show the
PGPASSWORD path a user takes.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtune.engine import free_port

PASSWORD = "kvtune-test-password"


@dataclass(frozen=True)
class Postgres:
    port: int

    @property
    def url(self) -> str:
        """The storage URL a user gives: no password in it (PGPASSWORD carries it)."""
        return f"postgresql://kvtune@127.0.0.1:{self.port}/sweeps"


def _bin(name: str) -> str:
    for folder in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (folder / name).is_file():
            return str(folder / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(
            f"PostgreSQL's {name} is not installed (make sysdeps installs Debian's postgresql)"
        )
    return found


def _as_server_user(command: list[str], data: Path) -> list[str]:
    if os.getuid() != 0:
        return command
    user = pwd.getpwnam("postgres")
    os.chown(data, user.pw_uid, user.pw_gid)
    return ["runuser", "-u", "postgres", "--", *command]


@contextlib.contextmanager
def postgres() -> Iterator[Postgres]:
    """A server for the test's duration. Its folder is a fresh one under the system temp folder: as root the
    server runs as `postgres`, which cannot enter pytest's per-user (0700) temp folders."""
    folder = Path(tempfile.mkdtemp(prefix="kvtune-pg-"))
    try:
        with _server(folder) as server:
            yield server
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def _server(folder: Path) -> Iterator[Postgres]:
    data = folder / "pgdata"
    data.mkdir(mode=0o700)
    password_file = folder / "pwfile"
    password_file.write_text(PASSWORD + "\n")
    if os.getuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(folder, user.pw_uid, user.pw_gid)
        os.chown(password_file, user.pw_uid, user.pw_gid)
    subprocess.run(
        _as_server_user(
            [_bin("initdb"), "-D", str(data), "-U", "kvtune", "--auth=scram-sha-256",
             f"--pwfile={password_file}", "--no-sync"],
            data,
        ),
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    port = free_port("127.0.0.1")
    options = f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories={folder} -c fsync=off"
    subprocess.run(
        _as_server_user([_bin("pg_ctl"), "-D", str(data), "-o", options, "-w", "-t", "60", "start",
                         "-l", str(folder / "server.log")], data),
        check=True, capture_output=True, timeout=90,
    )  # fmt: skip
    try:
        env = os.environ | {"PGPASSWORD": PASSWORD}
        subprocess.run(
            [_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "kvtune", "sweeps"],
            check=True, capture_output=True, timeout=60, env=env,
        )  # fmt: skip
        yield Postgres(port)
    finally:
        pid_file = data / "postmaster.pid"
        pid = int(pid_file.read_text().split()[0]) if pid_file.exists() else None
        subprocess.run(
            _as_server_user([_bin("pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "30", "stop"], data),
            capture_output=True, timeout=60,
        )  # fmt: skip
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
