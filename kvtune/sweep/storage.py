"""Where a shared sweep's study lives: the `--storage` URL judged, shown and opened.

A storage URL travels far: to the console, to each worker's command line, into the run folder's `study.json`,
into errors. So a URL carrying a credential is refused before it goes anywhere (a password after `USER:`,
a query parameter kvtune.credentials calls secret such as `password=`, `sslpassword=` or `sslkey=`, a token
anywhere, a `#fragment`), and the refusal never quotes it: PostgreSQL's client reads the password from
PGPASSWORD or ~/.pgpass, and every other connection setting from its PG* variable. The URL is judged as
urllib and as SQLAlchemy read it, since the two disagree (`postgresql://u:pw/x@host/db` has no password for
urllib and the password `pw/x` for SQLAlchemy).

Shared storage is read as untrusted: a journal file must be a regular file under MAX_JOURNAL_BYTES whose
lines are each under MAX_JOURNAL_LINE_BYTES of UTF-8 JSON records (read one bounded line at a time, every
time Optuna reads it, so a worker that wrote garbage is named, not replayed). Optuna's own errors on a
damaged journal or an unreachable database become one line naming `--storage`.

A dry run opens the storage read-only: a journal is never created or appended to, a database is read in
read-only transactions (PostgreSQL) and never given Optuna's tables; a storage that does not exist yet
reads as an empty one.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import optuna
import sqlalchemy
from optuna.storages import BaseStorage, InMemoryStorage, JournalStorage, RDBStorage
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._storage import JournalOperation
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from kvtune.config_errors import ConfigError
from kvtune.credentials import looks_secret, value_looks_secret
from kvtune.documents import read_json
from kvtune.files import name_problem, write_atomic

# Optuna replays a whole journal into memory (several times its size on disk). A sweep's journal holds a
# few lines per claim plus a progress note every few seconds of a trial: ~0.2 MB a trial, so 256 MiB is
# over a thousand trials. A larger file is not a sweep's journal, or a study for a database.
MAX_JOURNAL_BYTES = 256 * 1024 * 1024
# The longest record kvtune writes is the study's spec (a spec and its base profile, each under
# documents.MAX_DOCUMENT_BYTES, the profile twice, JSON-escaped) or one config's measured records.
MAX_JOURNAL_LINE_BYTES = 32 * 1024 * 1024
# Seconds an RDB storage may take to answer the first connection.
CONNECT_TIMEOUT_S = 10
# A run folder's record of the study it measures for, so `kvtune sweep --resume RUN` finds it again.
STUDY_RECORD = "study.json"

_USERINFO_ADVICE = (
    "remove it: export PGPASSWORD or put the password in ~/.pgpass (PostgreSQL's client reads either), "
    "so it never shows in `ps`, shell history, logs or the run folder"
)
_SETTING_ADVICE = (
    "remove it: PostgreSQL's client reads the password from PGPASSWORD or ~/.pgpass and other settings from "
    "their PG* variables (PGSSLKEY for sslkey), so none is on the command line"
)
_OPERATIONS = frozenset(int(operation) for operation in JournalOperation)
_KNOWN = "give a journal file path, postgresql://USER@HOST/DB or sqlite:///PATH"


# ---- the URL ---------------------------------------------------------------------------------------------


def is_journal(url: str) -> bool:
    """Whether `--storage URL` names a journal file (a path) rather than a database URL."""
    return "://" not in url


def secret_problem(url: str) -> str | None:
    """Why URL may not be given as `--storage` because it carries a credential, or None. The text never
    quotes the URL or any part of it that may be the credential."""
    if is_journal(url):
        return (
            "the path looks like a credential (a token); give the path of a journal file"
            if value_looks_secret(url)
            else None
        )
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return f"is not a URL kvtune can read (not shown: it may hold a credential); {_KNOWN}"
    if password is not None:
        return f"the URL holds a password (after 'USER:'); {_USERINFO_ADVICE}"
    if parts.fragment or "#" in url:
        return (
            "the URL has a '#' part, which a storage URL never needs and may hide a credential; remove it "
            "(a password goes in PGPASSWORD or ~/.pgpass)"
        )
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if value_looks_secret(key):
            return f"a query parameter of the URL looks like a credential itself; {_SETTING_ADVICE}"
        if looks_secret(key):
            return f"the URL's query sets {key[:40]!r}, a credential; {_SETTING_ADVICE}"
        if value_looks_secret(value):
            return f"the URL's query sets {key[:40]!r} to what looks like a credential; {_SETTING_ADVICE}"
    if value_looks_secret(url):
        return f"the URL holds what looks like a credential (a token); {_SETTING_ADVICE}"
    return _sqlalchemy_secret_problem(url)


def _sqlalchemy_secret_problem(url: str) -> str | None:
    """The URL as SQLAlchemy, which opens it, reads it: a password or a secret setting it would pass on."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None  # not a database URL SQLAlchemy reads: the scheme check says so, without quoting it
    if parsed.password is not None:
        return f"the URL holds a password (after 'USER:'); {_USERINFO_ADVICE}"
    for key, value in parsed.query.items():
        values = value if isinstance(value, tuple) else (value,)
        if looks_secret(key) or value_looks_secret(key) or any(value_looks_secret(v) for v in values):
            return f"the URL's query holds a credential; {_SETTING_ADVICE}"
    return None


def shown_url(url: str) -> str:
    """URL as it may be printed, stored or logged: itself when it carries no credential; else without its
    password, its fragment and its secret query parameters, or only its scheme when even that is unsafe."""
    if secret_problem(url) is None:
        return url
    if is_journal(url):
        return "(a path not shown: it looks like a credential)"
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        netloc = f"{parts.username}@{host}" if parts.username else host
        if parts.port:
            netloc += f":{parts.port}"
        query = [
            (key, value)
            for key, value in parse_qsl(parts.query, keep_blank_values=True)
            if not (looks_secret(key) or value_looks_secret(key) or value_looks_secret(value))
        ]
        shown = urlunsplit((parts.scheme, netloc, parts.path, "&".join(f"{k}={v}" for k, v in query), ""))
    except ValueError:
        shown = ""
    if shown and "#" not in shown and secret_problem(shown) is None:
        return shown
    scheme = url.split("://", 1)[0]
    return f"{scheme}://(not shown: it holds a credential)" if scheme.isalnum() else "(not shown)"


def storage_problem(url: str) -> str | None:
    """Why URL cannot be `--storage` (a credential in it, a scheme kvtune has no driver for), or None."""
    if not url:
        return f"is empty; {_KNOWN}"
    secret = secret_problem(url)
    if secret is not None or is_journal(url):
        return secret
    scheme = urlsplit(url).scheme
    if scheme in ("postgresql", "postgres") or scheme.startswith(("postgresql+", "sqlite", "mysql")):
        return None
    shown = f"{scheme}://" if scheme.isascii() and scheme.replace("+", "").isalnum() else "that scheme"
    return f"{shown} is not a storage kvtune knows; {_KNOWN}"


def _refuse(url: str, problem: str) -> ConfigError:
    return ConfigError(f"--storage {shown_url(url)}: {problem}")


# ---- opening ---------------------------------------------------------------------------------------------


def open_storage(url: str, *, read_only: bool = False, heartbeat_s: int, grace_s: int) -> BaseStorage:
    """Optuna's storage at URL: a journal file path, or an RDB URL (sqlite:///, postgresql://, mysql://).

    READ_ONLY (a dry run): nothing is created or written; a storage not there yet reads as an empty one.
    ConfigError naming --storage when the URL holds a credential, names no driver kvtune has, the journal
    is not one, or the database does not answer within CONNECT_TIMEOUT_S."""
    problem = storage_problem(url)
    if problem:
        raise ConfigError(f"--storage: {problem}") if secret_problem(url) else _refuse(url, problem)
    if is_journal(url):
        return _open_journal(url, read_only=read_only)
    return _open_database(url, read_only=read_only, heartbeat_s=heartbeat_s, grace_s=grace_s)


def _open_journal(url: str, *, read_only: bool) -> BaseStorage:
    path = Path(url)
    try:
        if not path.parent.is_dir():
            raise _refuse(url, f"the folder {path.parent} does not exist; create it first")
        mode = path.stat().st_mode
    except FileNotFoundError:
        if read_only:
            return InMemoryStorage()  # no journal yet: an empty storage, and none is created
        mode = None
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, a loop of links
        raise _refuse(url, f"cannot be used ({getattr(exc, 'strerror', None) or exc})") from None
    if mode is not None:
        if not stat.S_ISREG(mode):
            raise _refuse(
                url, "is not a regular file (a folder, device or pipe); give the path of a journal file"
            )
        size = path.stat().st_size
        if size > MAX_JOURNAL_BYTES:
            raise _refuse(
                url,
                f"is {size / 2**20:,.0f} MiB, larger than the {MAX_JOURNAL_BYTES / 2**20:g} MiB kvtune reads "
                "as a journal (Optuna replays it into memory): check the path, or share a study this large "
                "through a database (postgresql://USER@HOST/DB)",
            )
    try:
        return JournalStorage(BoundedJournal(url, read_only=read_only))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - Optuna's replay of records it cannot apply: any error type
        raise _refuse(
            url,
            f"holds records Optuna cannot replay ({type(exc).__name__}); it is not a journal kvtune wrote: "
            "check the path, or move the file aside to start the study anew",
        ) from None


class BoundedJournal(JournalFileBackend):
    """Optuna's journal file, read one bounded line at a time and refused line by line when a line is not a
    UTF-8 JSON journal record (Optuna's reader reads a line whole, however long, and fails on bad bytes with
    a traceback). READ_ONLY: the file is never created and nothing is appended."""

    def __init__(self, path: str, *, read_only: bool = False) -> None:
        self.read_only = read_only
        if read_only:  # JournalFileBackend's constructor would create the file
            self._file_path = path
            self._log_number_offset = {0: 0}
            return
        super().__init__(path)

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        if self.read_only:
            raise RuntimeError("a read-only journal was written to (a dry run writes nothing)")
        super().append_logs(logs)

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        if self.read_only and not Path(self._file_path).exists():
            return
        with open(self._file_path, "rb") as file:  # noqa: PTH123 - the path Optuna's backend keeps
            # What the file held when reading began: another worker may be appending meanwhile.
            size = os.fstat(file.fileno()).st_size
            start = log_number_from if log_number_from in self._log_number_offset else 0
            position = self._log_number_offset[start]
            file.seek(position)
            for number in itertools.count(start):
                line = file.readline(MAX_JOURNAL_LINE_BYTES + 1)
                if not line or position + len(line) > size:
                    return
                if not line.endswith(b"\n"):
                    if len(line) > MAX_JOURNAL_LINE_BYTES:
                        raise self._damaged(
                            number + 1, f"is longer than {MAX_JOURNAL_LINE_BYTES / 2**20:g} MiB"
                        )
                    return  # the last record, still being written by another worker (as Optuna reads it)
                position += len(line)
                self._log_number_offset.setdefault(number + 1, position)
                if number >= log_number_from:
                    yield self._record(line, number + 1)

    def _record(self, line: bytes, number: int) -> dict[str, Any]:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._damaged(number, f"is not UTF-8 text (at byte {exc.start})") from None
        try:
            record: object = json.loads(text)
        except (ValueError, RecursionError):
            raise self._damaged(number, "is not a JSON record") from None
        if not isinstance(record, dict):
            raise self._damaged(number, "is not an Optuna journal record")
        op_code = record.get("op_code")
        if type(op_code) is not int or op_code not in _OPERATIONS:
            raise self._damaged(number, "is not an Optuna journal record")
        return record

    def _damaged(self, number: int, problem: str) -> ConfigError:
        return _refuse(
            self._file_path,
            f"line {number:,} {problem}: this is not an Optuna journal kvtune wrote; check the path, or move "
            "the file aside to start the study anew",
        )


def _open_database(url: str, *, read_only: bool, heartbeat_s: int, grace_s: int) -> BaseStorage:
    given = url
    parts = urlsplit(url)
    connect_args: dict[str, Any] = {}
    postgres = parts.scheme in ("postgresql", "postgres") or parts.scheme.startswith("postgresql+")
    if parts.scheme in ("postgresql", "postgres"):
        url = urlunsplit(parts._replace(scheme="postgresql+psycopg"))
    if postgres:
        connect_args = {"connect_timeout": CONNECT_TIMEOUT_S}
        if read_only:  # the server itself refuses any write of this session
            user_options = make_url(url).query.get("options")
            options = user_options if isinstance(user_options, str) else " ".join(user_options or ())
            connect_args["options"] = f"{options} -c default_transaction_read_only=on".strip()
    try:
        if read_only and not _has_optuna_tables(url, connect_args):
            return InMemoryStorage()  # a database without Optuna's tables holds no study; none are made
        with warnings.catch_warnings():
            # The heartbeat is flagged experimental; pyproject pins optuna, so it cannot change under us.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return RDBStorage(
                url,
                engine_kwargs={"connect_args": connect_args},
                heartbeat_interval=heartbeat_s,
                grace_period=grace_s,
                skip_table_creation=read_only,
            )
    except Exception as exc:  # noqa: BLE001 - any driver's error: its first line says enough
        raise _refuse(given, f"cannot open it: {driver_error(exc, given, url)}") from None


def _has_optuna_tables(url: str, connect_args: dict[str, Any]) -> bool:
    """Whether the database holds Optuna's tables, asked without creating anything (SQLite creates a file it
    connects to, so a missing one is not connected to)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and (
        not parsed.database or parsed.database == ":memory:" or not Path(parsed.database).is_file()
    ):
        return False
    engine = sqlalchemy.create_engine(url, connect_args=connect_args)
    try:
        inspector = sqlalchemy.inspect(engine)
        return inspector.has_table("version_info") and inspector.has_table("alembic_version")
    finally:
        engine.dispose()


def driver_error(exc: BaseException, *urls: str) -> str:
    """An exception from SQLAlchemy or a database driver as one line that holds no URL and no credential:
    its first line, each URL given replaced by its shown form, and nothing at all when it still looks like
    it holds a credential (a driver may echo its connection string, or the password from the environment)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    for url in urls:
        line = line.replace(url, shown_url(url))
    environment_secrets = [
        value for name, value in os.environ.items() if looks_secret(name) and len(value) >= 4
    ]
    if value_looks_secret(line) or any(secret in line for secret in environment_secrets):
        return f"{type(exc).__name__} (its message is not shown: it may hold a credential)"
    return line[:300]


# ---- the run folder's record ---------------------------------------------------------------------------


class StudyRecord(BaseModel):
    """Where a worker's run folder finds its study again (`study.json`): the storage and the study's name."""

    model_config = ConfigDict(extra="forbid", strict=True)

    storage: str = Field(description="the --storage URL, which holds no credential")
    study: str = Field(description="the study's name in that storage")

    @field_validator("storage")
    @classmethod
    def _no_credential(cls, storage: str) -> str:
        problem = storage_problem(storage)
        if problem:
            raise ValueError(problem)
        return storage

    @field_validator("study")
    @classmethod
    def _a_name(cls, study: str) -> str:
        problem = name_problem(study)
        if problem:
            raise ValueError(problem)
        return study

    def write(self, run: Path) -> None:
        write_atomic(run / STUDY_RECORD, self.model_dump_json(indent=2) + "\n")

    @classmethod
    def of_run(cls, run: Path) -> StudyRecord | None:
        """The record in RUN, None when RUN measured no shared study; ConfigError naming the file when it is
        not a record kvtune wrote (its values are never quoted: the file may have been edited)."""
        path = run / STUDY_RECORD
        if not path.is_file():
            return None
        data = read_json(path, "a study record")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            field = ".".join(str(part) for part in first["loc"]) or "the document"
            reason = {
                "value_error": str(first["msg"]).removeprefix("Value error, "),
                "missing": "missing",
                "extra_forbidden": "not a field of it",
            }.get(first["type"], "not a text value")
            raise ConfigError(
                f"{path}: is not a study record kvtune wrote ({field}: {reason}); fix or remove it"
            ) from None
