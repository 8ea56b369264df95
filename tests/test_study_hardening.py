"""Shared sweep storage as an attacker or a careless user meets it: storage URLs with a credential in any
part are refused without quoting it, study names (given, or read back from the shared storage) go through
the one name rule, a dry run writes nothing anywhere, and a journal that is not one is a one-line error in
bounded time and memory. Inputs are generated (hypothesis) where the issue asks for it."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
import sqlalchemy
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import main as cli_main
from kvtune.config_errors import ConfigError
from kvtune.credentials import looks_secret
from kvtune.files import name_problem
from kvtune.sweep import storage as storage_module
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.spec import load_spec
from kvtune.sweep.storage import MAX_JOURNAL_BYTES, StudyRecord, shown_url, storage_problem
from kvtune.sweep.study import SharedStudy, StoredSpec, open_storage
from tests.helpers_sweep import OUTPUTS_SPEC
from tests.peak_rss import measured as rss_measured
from tests.peak_rss import read_report
from tests.postgres_server import PASSWORD, postgres

ROOT = Path(__file__).resolve().parents[1]
PLANT = "PLANTzq"  # every generated secret starts so: grep for it anywhere
SECRETS = st.text("abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789", min_size=6, max_size=24).map(
    lambda tail: PLANT + tail
)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def write_spec(folder: Path) -> Path:
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(OUTPUTS_SPEC | {"name": "shared"}))
    return path


def kvtune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtune.cli", *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=os.environ | (env or {}),
    )  # fmt: skip


def in_process(*args: str) -> tuple[int, str]:
    """`kvtune ARGS` in this process (fast enough for generated inputs): exit code and everything printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli_main(list(args))
    return code, out.getvalue()


def files_under(folder: Path) -> dict[str, bytes | str]:
    """Every file, folder and link under FOLDER with its content: a snapshot to compare before and after."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            found[key] = f"-> {path.readlink()}"
        elif path.is_file():
            found[key] = path.read_bytes()
        else:
            found[key] = "folder"
    return found


# ---- credentials in a storage URL ------------------------------------------------------------------------

SCHEMES = st.sampled_from(
    ["postgresql", "postgres", "postgresql+psycopg", "sqlite", "mysql", "mysql+pymysql"]
)
HOSTS = st.sampled_from(["127.0.0.1", "db.internal", "[::1]", "localhost"])
PORTS = st.sampled_from(["", ":5432", ":9"])
HARMLESS = st.sampled_from(
    [
        ("sslmode", "require"),
        ("connect_timeout", "5"),
        ("application_name", "kvtune"),
        ("target_session_attrs", "any"),
    ]
)
SECRET_KEYS = st.one_of(
    st.sampled_from(
        [
            "password",
            "pass",
            "sslpassword",
            "PASSWORD",
            "Password",
            "passwd",
            "sslkey",
            "api_key",
            "token",
            "client_secret",
            "auth_token",
            "PGPASSWORD",
        ]
    ),
    st.from_regex(r"[a-z]{1,8}_?(token|secret|password|pass|key)", fullmatch=True),
).filter(looks_secret)


POSITIONS = ["password", "password-with-slash", "empty-user", "query", "encoded-key", "token-value",
             "fragment", "fragment-pair", "token-user", "token-db"]  # fmt: skip


def percent_encoded(text: str) -> str:
    return "".join(f"%{byte:02X}" for byte in text.encode())


@st.composite
def secret_urls(draw: st.DrawFn) -> tuple[str, str]:
    """A database URL and the secret planted in it, in one of the positions a credential can take."""
    secret = draw(SECRETS)
    scheme, host, port = draw(SCHEMES), draw(HOSTS), draw(PORTS)
    before = draw(st.lists(HARMLESS, max_size=2))
    after = draw(st.lists(HARMLESS, max_size=2))
    user = draw(st.sampled_from(["kvtune", "u"]))
    query = [*before]
    userinfo = f"{user}@"
    fragment = ""
    position = draw(st.sampled_from(POSITIONS))
    database = "sweeps"
    if position == "password":
        userinfo = f"{user}:{secret}@"
    elif position == "password-with-slash":  # no password for urllib, the password 'x/SECRET' for SQLAlchemy
        userinfo = f"{user}:x/{secret}@"
    elif position == "empty-user":
        userinfo = f":{secret}@"
    elif position == "query":
        query.append((draw(SECRET_KEYS), secret))
    elif position == "encoded-key":
        query.append((percent_encoded(draw(SECRET_KEYS)), secret))
    elif position == "token-value":
        query.append(("options", f"hf_{secret}abcdefghijklmnopqrstu"))
    elif position == "fragment":
        fragment = f"#{secret}"
    elif position == "fragment-pair":
        fragment = f"#password={secret}"
    elif position == "token-user":
        userinfo = f"ghp_{secret}abcdefghijklmnopqrstu@"
    else:
        database = f"sk-{secret}abcdefghijkl"
    query += after
    text = "&".join(f"{key}={value}" for key, value in query)
    url = f"{scheme}://{userinfo}{host}{port}/{database}{'?' + text if text else ''}{fragment}"
    return url, secret


@FAST
@given(secret_urls())
def test_a_credential_anywhere_in_a_storage_url_is_refused_and_never_shown(planted: tuple[str, str]) -> None:
    url, secret = planted
    problem = storage_problem(url)
    assert problem is not None, url
    assert secret not in problem and PLANT not in problem
    assert PLANT not in shown_url(url), shown_url(url)
    with pytest.raises(ConfigError) as refused:
        open_storage(url, read_only=True)
    assert PLANT not in str(refused.value) and "--storage" in str(refused.value)
    assert "PGPASSWORD" in str(refused.value)


@FAST
@given(SCHEMES.filter(lambda s: s.startswith("postgres")), HOSTS, PORTS, st.lists(HARMLESS, max_size=4))
def test_a_storage_url_without_a_credential_is_accepted_and_shown_as_given(
    scheme: str, host: str, port: str, query: list[tuple[str, str]]
) -> None:
    text = "&".join(f"{key}={value}" for key, value in query)
    url = f"{scheme}://kvtune{port and ''}@{host}{port}/sweeps{'?' + text if text else ''}"
    assert storage_problem(url) is None
    assert shown_url(url) == url


@settings(max_examples=25, deadline=None)
@given(secret_urls())
def test_the_cli_refuses_a_credential_in_one_line_before_anything(planted: tuple[str, str]) -> None:
    url, secret = planted
    for args in (["--join", "shared"], ["--collect", "shared"], ["--join", "shared", "--dry-run"]):
        code, output = in_process("sweep", *args, "--storage", url, "--runs-dir", "/nonexistent/kvtune-runs")
        assert code == 2, output
        assert secret not in output and PLANT not in output, output
        assert "Traceback" not in output and "--storage" in output
        assert len(output.strip().splitlines()) == 1, output


def test_the_refusal_as_a_user_meets_it(tmp_path: Path) -> None:
    """The real command line: exit 2, one line naming --storage and the fix, the secret nowhere (stdout,
    stderr, files), nothing written."""
    spec = write_spec(tmp_path)
    runs = tmp_path / "runs"
    secret = f"{PLANT}userfacing"
    before = files_under(tmp_path)
    for url, extra in (
        (f"postgresql://kvtune@127.0.0.1:9/sweeps?password={secret}", []),
        (f"postgresql://kvtune@127.0.0.1:9/sweeps?sslmode=require&sslpassword={secret}", ["--dry-run"]),
        (f"postgresql://kvtune:{secret}@127.0.0.1:9/sweeps", ["--dashboard", "8080", "--dashboard-writable"]),
        (f"postgresql://kvtune@127.0.0.1:9/sweeps#{secret}", ["--parallel", "2"]),
    ):
        done = kvtune("sweep", str(spec), "--storage", url, "--runs-dir", str(runs), *extra)
        output = done.stdout + done.stderr
        assert done.returncode == 2, output
        assert secret not in output and "Traceback" not in output
        assert output.strip().count("\n") == 0 and "--storage" in output and "PGPASSWORD" in output
    assert files_under(tmp_path) == before


def test_a_driver_error_that_echoes_a_credential_is_not_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGPASSWORD", f"{PLANT}fromenv")
    echoed = RuntimeError(f'connection to "db" failed: password "{PLANT}fromenv" rejected\nmore')
    line = storage_module.driver_error(echoed, "postgresql://kvtune@db/sweeps")
    assert PLANT not in line and "RuntimeError" in line
    url_echo = RuntimeError("could not parse postgresql://kvtune:hunter22@db/x")
    assert "hunter22" not in storage_module.driver_error(url_echo, "postgresql://kvtune:hunter22@db/x")
    plain = storage_module.driver_error(RuntimeError("connection refused\nstack"), "postgresql://k@db/s")
    assert plain == "connection refused"


def test_a_study_record_with_a_credential_is_refused_unquoted(tmp_path: Path) -> None:
    """study.json is read back by --resume: a hand-edited one is judged like the flag."""
    secret = f"{PLANT}inrecord"
    (tmp_path / "study.json").write_text(
        json.dumps({"storage": f"postgresql://u@h/db?password={secret}", "study": "shared"})
    )
    code, output = in_process("sweep", "--resume", str(tmp_path), "--dry-run")
    assert code == 2 and secret not in output and "study.json" in output and "storage" in output, output
    (tmp_path / "study.json").write_text(json.dumps({"storage": str(tmp_path / "j"), "study": "../../x"}))
    code, output = in_process("sweep", "--resume", str(tmp_path))
    assert code == 2 and "cannot be a name" in output, output
    (tmp_path / "study.json").write_text(json.dumps({"storage": {"password": secret}, "study": "x"}))
    code, output = in_process("sweep", "--resume", str(tmp_path))
    assert code == 2 and secret not in output and "not a text value" in output, output


# ---- names that become paths -------------------------------------------------------------------------------

NAMES = st.one_of(
    st.text(max_size=70),
    st.sampled_from(
        ["../../x", "..", ".", "a/b", "/abs", "-x", ".hidden", "x" * 64, "ok\x1b[31m", "ok\n", "ok name"]
    ),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", fullmatch=True),
)


@FAST
@given(name=NAMES)
def test_every_study_name_goes_through_the_name_rule(tmp_path: Path, name: str) -> None:
    """--study, --join and --collect: a name the rule refuses exits 2 naming the flag, before the storage is
    read; a name it accepts gets as far as the storage (which holds no such study). Nothing is written."""
    journal = tmp_path / "names.journal"
    spec = write_spec(tmp_path)
    bad = name_problem(name) is not None
    for flag in ("--join", "--collect", "--study"):
        args = [str(spec)] if flag == "--study" else []
        code, output = in_process("sweep", *args, f"{flag}={name}", "--storage", str(journal), "--dry-run")
        if bad:
            assert code == 2 and f"{flag}: " in output and "cannot be a name" in output, output
        elif flag == "--study":
            assert code == 0 and "would create it" in output, output
        else:
            assert code == 2 and "no such study" in output, output
        assert "Traceback" not in output
    assert not journal.exists(), "a dry run created the journal"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]


def _forge(journal: Path, name: str, spec_path: Path) -> None:
    """A study written straight to the shared storage by someone else, under NAME, with kvtune's spec."""
    storage = open_storage(str(journal))
    study = optuna.create_study(study_name=name, storage=storage)
    spec = load_spec(spec_path)
    storage.set_study_system_attr(study._study_id, "kvtune_spec", StoredSpec.of(spec, spec_path).as_attr())


def test_names_read_back_from_the_storage_are_checked(tmp_path: Path) -> None:
    journal, spec, runs = tmp_path / "s.journal", write_spec(tmp_path), tmp_path / "runs"
    _forge(journal, "../../escape\x1b[2J", spec)
    _forge(journal, "good", spec)
    code, output = in_process(
        "sweep", "--join", "../../escape\x1b[2J", "--storage", str(journal), "--dry-run"
    )
    assert code == 2 and "--join: " in output and "\x1b" not in output, output
    code, output = in_process("sweep", "--join", "nope", "--storage", str(journal), "--runs-dir", str(runs))
    assert code == 2 and "studies there: good, and 1 named against kvtune's name rule" in output, output
    assert "escape" not in output and "\x1b" not in output
    assert not runs.exists()
    assert not (tmp_path.parent / "escape").exists()


def test_a_record_whose_config_id_is_not_its_knobs_is_refused(tmp_path: Path) -> None:
    """A record's config id names folders (the drift sentinel's): one forged in the storage never does."""
    journal, spec_path = tmp_path / "s.journal", write_spec(tmp_path)
    spec = load_spec(spec_path)
    study = SharedStudy.create_or_join(open_storage(str(journal)), "shared", StoredSpec.of(spec, spec_path))
    knobs = {"max_num_seqs": 2, "max_model_len": 1024}
    claim = study.claim(knobs)
    assert claim is not None
    record = TrialRecord(trial=1, config_id="../../x", knobs=knobs, status="done", goodput=0.5, steps=[])
    study.finish(claim, [record], 0.5)
    with pytest.raises(ConfigError, match="holds a record kvtune did not write"):
        study.records()


def test_text_from_the_storage_is_shown_without_terminal_escapes(tmp_path: Path) -> None:
    journal, spec_path = tmp_path / "s.journal", write_spec(tmp_path)
    spec = load_spec(spec_path)
    study = SharedStudy.create_or_join(open_storage(str(journal)), "shared", StoredSpec.of(spec, spec_path))
    claim = study.claim({"max_num_seqs": 2, "max_model_len": 1024})
    assert claim is not None
    study.storage.set_trial_system_attr(claim.trial_id, "kvtune_worker", {"name": "evil\x1b]0;pwned\x07"})
    study.storage.set_trial_user_attr(claim.trial_id, "progress", "step\x1b[2J" + "x" * 5000)
    ((worker, _knobs, note),) = study.running()
    assert "\x1b" not in worker + note and "\x07" not in worker and len(note) < 300


# ---- a dry run writes nothing --------------------------------------------------------------------------


def test_a_dry_run_writes_nothing_to_a_journal_or_the_runs_dir(tmp_path: Path) -> None:
    spec_path, runs = write_spec(tmp_path), tmp_path / "runs"
    journal = tmp_path / "shared.journal"
    spec = load_spec(spec_path)
    SharedStudy.create_or_join(open_storage(str(journal)), "shared", StoredSpec.of(spec, spec_path))
    run = tmp_path / "a-run"
    run.mkdir()
    (run / "spec.yaml").write_text(spec_path.read_text())
    StudyRecord(storage=str(journal), study="shared").write(run)
    before = files_under(tmp_path)
    commands = [
        [str(spec_path), "--storage", str(journal)],
        [str(spec_path), "--storage", str(journal), "--study", "another"],
        [str(spec_path), "--storage", str(tmp_path / "new.journal")],
        [str(spec_path), "--storage", f"sqlite:///{tmp_path}/new.db"],
        ["--join", "shared", "--storage", str(journal)],
        ["--collect", "shared", "--storage", str(journal)],
        ["--resume", str(run)],
    ]
    for args in commands:
        code, output = in_process("sweep", *args, "--runs-dir", str(runs), "--dry-run")
        assert code == 0, (args, output)
        assert "trial(s)" in output and "would" in output, output
    assert files_under(tmp_path) == before, "a dry run wrote"


def _database_snapshot(url: str) -> dict[str, list[str]]:
    """Every table of the database and its rows."""
    engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    snapshot: dict[str, list[str]] = {}
    try:
        with engine.connect() as connection:
            for table in sorted(sqlalchemy.inspect(connection).get_table_names()):
                query = sqlalchemy.select(sqlalchemy.text("*")).select_from(sqlalchemy.table(table))
                snapshot[table] = sorted(repr(tuple(row)) for row in connection.execute(query))
    finally:
        engine.dispose()
    return snapshot


@pytest.fixture
def database(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with postgres() as server:
        monkeypatch.setenv("PGPASSWORD", PASSWORD)
        yield server.url


def test_a_dry_run_writes_nothing_to_postgresql(tmp_path: Path, database: str) -> None:
    """An empty database gets no tables from a dry run; one holding the study gets no row more or less."""
    spec_path, runs = write_spec(tmp_path), tmp_path / "runs"
    code, output = in_process(
        "sweep", str(spec_path), "--storage", database, "--runs-dir", str(runs), "--dry-run"
    )
    assert code == 0 and "would create it" in output, output
    assert _database_snapshot(database) == {}, "a dry run created Optuna's tables"
    code, output = in_process("sweep", "--join", "shared", "--storage", database, "--dry-run")
    assert code == 2 and "no such study" in output, output
    spec = load_spec(spec_path)
    study = SharedStudy.create_or_join(open_storage(database), "shared", StoredSpec.of(spec, spec_path))
    claim = study.claim({"max_num_seqs": 2, "max_model_len": 1024})
    assert claim is not None
    before = _database_snapshot(database)
    assert before["studies"], "the study is there"
    for args in (
        [str(spec_path), "--storage", database],
        ["--join", "shared", "--storage", database],
        ["--collect", "shared", "--storage", database],
    ):
        code, output = in_process("sweep", *args, "--runs-dir", str(runs), "--dry-run")
        assert code == 0 and "would join it" in output, output
    assert _database_snapshot(database) == before, "a dry run wrote to the database"
    assert not runs.exists()
    assert PASSWORD not in output


# ---- a journal read with bounds ----------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=2000))
def test_any_bytes_in_a_journal_open_or_fail_in_one_line(content: bytes) -> None:
    """Whatever a shared journal holds, opening it gives a storage or a ConfigError naming --storage: never a
    traceback from Optuna's reader (UnicodeDecodeError, KeyError, AssertionError)."""
    with tempfile.TemporaryDirectory() as folder:
        journal = Path(folder) / "j.journal"
        journal.write_bytes(content)
        for read_only in (True, False):
            try:
                storage = open_storage(str(journal), read_only=read_only)
            except ConfigError as exc:
                assert str(exc).startswith(f"--storage {journal}: ") and "\n" not in str(exc)
            else:
                storage.get_all_studies()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"\xff\xfe garbage\n", "line 1 is not UTF-8 text"),
        (b"not json\n", "line 1 is not a JSON record"),
        (b"[]\n", "line 1 is not an Optuna journal record"),
        (b'{"op_code": 99}\n', "line 1 is not an Optuna journal record"),
        (b'{"op_code": true}\n', "line 1 is not an Optuna journal record"),
        (b"[" * 100_000 + b"\n", "line 1 is not a JSON record"),
        (b'{"op_code": 0}\n', "holds records Optuna cannot replay (KeyError)"),
    ],
)
def test_a_journal_that_is_not_one_is_named_with_its_line(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    journal = tmp_path / "j.journal"
    journal.write_bytes(content)
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        open_storage(str(journal))


def test_a_journal_that_is_not_a_file_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.journal"
    os.mkfifo(fifo)
    (tmp_path / "dev.journal").symlink_to("/dev/zero")
    (tmp_path / "dir.journal").mkdir()
    started = time.monotonic()
    for name in ("fifo.journal", "dev.journal", "dir.journal"):
        with pytest.raises(ConfigError, match="is not a regular file"):
            open_storage(str(tmp_path / name))
    assert time.monotonic() - started < 5


def test_garbage_written_by_another_worker_mid_run_is_named(tmp_path: Path) -> None:
    journal, spec_path = tmp_path / "s.journal", write_spec(tmp_path)
    spec = load_spec(spec_path)
    study = SharedStudy.create_or_join(open_storage(str(journal)), "shared", StoredSpec.of(spec, spec_path))
    with journal.open("ab") as out:
        out.write(b"\x00\xff\n")
    with pytest.raises(ConfigError, match=r"line \d+ is not UTF-8 text"):
        study.claimed_configs()


def test_a_journal_over_the_cap_is_refused_naming_the_cap(tmp_path: Path) -> None:
    journal = tmp_path / "big.journal"
    with journal.open("wb") as out:
        out.truncate(MAX_JOURNAL_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match=r"larger than the 256 MiB kvtune reads as a journal"):
        open_storage(str(journal))


def test_a_large_one_line_journal_is_refused_in_seconds_and_bounded_memory(tmp_path: Path) -> None:
    """200 MB without a line break (Optuna's reader took it whole: 570 MB and an AssertionError): the CLI
    reads at most one line's cap and says so (here: 214 MiB peak, 151 MiB of it the imports)."""
    journal, report = tmp_path / "big.journal", tmp_path / "rss.json"
    with journal.open("wb") as out:
        out.truncate(200 * 1024 * 1024 - 1)
        out.seek(0, os.SEEK_END)
        out.write(b"\n")
    started = time.monotonic()
    done = subprocess.run(
        rss_measured([sys.executable, "-m", "kvtune.cli", "sweep", "--join", "shared", "--storage",
                      str(journal), "--dry-run"], report),
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    code, peak = read_report(report)
    assert code == 2, done.stderr
    assert "line 1 is longer than 32 MiB" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert elapsed < 60
    assert peak < 320 * 1024 * 1024, f"peak RSS {peak / 2**20:.0f} MiB"
