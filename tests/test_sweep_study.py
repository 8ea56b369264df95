"""Several workers on one sweep through a shared Optuna study (a journal file): every config measured once,
a killed worker's config measured again by another, one report naming each config's worker, and bad
storage, join and spec refused before anything runs. Trials are scripted (tests/study_worker.py): what is
tested is the claiming, not the engines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.config_errors import ConfigError
from kvtune.sweep import run_dir
from kvtune.sweep.records import config_id
from kvtune.sweep.spec import load_spec
from kvtune.sweep.study import SharedStudy, StoredSpec, fingerprint, open_storage, shown_url
from kvtune.sweep.sweeper import run_sweep
from tests.builders import Quiet
from tests.helpers_sweep import OUTPUTS_SPEC
from tests.postgres_server import PASSWORD, postgres

ROOT = Path(__file__).resolve().parents[1]
SPACE = {"max_num_seqs": [2, 4, 8, 16], "max_model_len": [1024]}
CONFIGS = {config_id({"max_num_seqs": n, "max_model_len": 1024}) for n in SPACE["max_num_seqs"]}


def write_spec(folder: Path, **changes: Any) -> Path:
    path = folder / "study-spec.yaml"
    path.write_text(yaml.safe_dump(OUTPUTS_SPEC | {"name": "shared", "space": SPACE} | changes))
    return path


def worker(storage: Path | str, runs: Path, seconds: float, *how: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.study_worker", str(storage), str(runs), str(seconds), *how],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    _, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err.decode()


def study_of(storage: Path | str) -> SharedStudy:
    return SharedStudy.join(open_storage(str(storage)), "shared")[0]


def test_two_workers_measure_every_config_once(tmp_path: Path) -> None:
    spec, storage, runs = write_spec(tmp_path), tmp_path / "study.journal", tmp_path / "runs"
    runs.mkdir()
    first = worker(storage, runs, 0.5, "--spec", str(spec))
    deadline = time.monotonic() + 60
    while not any(runs.glob("claimed-*")):  # the study exists once the first worker claims a config
        assert time.monotonic() < deadline and first.poll() is None, "the first worker never claimed a config"
        time.sleep(0.1)
    second = worker(storage, runs, 0.5, "--join", "shared")
    finish(first)
    finish(second)
    records = study_of(storage).records()
    assert sorted(r.config_id for r in records) == sorted(CONFIGS), "every config measured exactly once"
    assert {r.worker for r in records} <= {
        f"{os.uname().nodename}:{first.pid}",
        f"{os.uname().nodename}:{second.pid}",
    }


@pytest.fixture(params=["journal", "postgresql"])
def storage_url(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """A journal file, or a PostgreSQL database (a server of its own; password from PGPASSWORD)."""
    if request.param == "journal":
        yield str(tmp_path / "study.journal")
        return
    with postgres() as server:
        monkeypatch.setenv("PGPASSWORD", PASSWORD)
        yield server.url


def test_a_killed_worker_s_config_is_measured_by_another_and_the_report_names_workers(
    tmp_path: Path, storage_url: str
) -> None:
    spec, storage, runs = write_spec(tmp_path), storage_url, tmp_path / "runs"
    runs.mkdir()
    beat = ["--heartbeat", "1", "--grace", "3"]  # a database fails a silent claim after 3 s
    doomed = worker(storage, runs, 600, "--spec", str(spec), *beat)
    deadline = time.monotonic() + 60
    while not (claimed := list(runs.glob("claimed-*"))):
        assert time.monotonic() < deadline and doomed.poll() is None, "the worker never claimed a config"
        time.sleep(0.1)
    held = claimed[0].name.removeprefix("claimed-")
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.wait(timeout=30)
    survivor = worker(storage, runs, 0.1, "--join", "shared", *beat)
    finish(survivor)
    assert PASSWORD not in storage
    records = study_of(storage).records()
    assert sorted(r.config_id for r in records) == sorted(CONFIGS)
    again = next(r for r in records if r.config_id == held)
    assert again.worker == f"{os.uname().nodename}:{survivor.pid}", "the dead worker's config, measured again"
    # One report from the study's records: `--collect` measures nothing and names each config's worker.
    study = study_of(storage)
    joined = run_dir.create_joined(tmp_path / "runs", "shared", *_stored(study)[:2])
    outcome = run_sweep(
        run_dir.open_existing(joined), joined, model_path=None, progress=Quiet(), study=study, measure=False,
        trial_runner=_never,
    )  # fmt: skip
    report = outcome.outputs["report_md"].read_text()
    assert "| Worker |" in report and f"{os.uname().nodename}:{survivor.pid}" in report


def _never(*_: Any, **__: Any) -> Any:
    raise AssertionError("--collect measured a config")


def _stored(study: SharedStudy) -> tuple[str, str]:
    spec = study.storage.get_study_system_attrs(study.study._study_id)["kvtune_spec"]
    return spec["spec_yaml"], spec["base_profile"]


def test_a_study_holding_another_spec_is_refused_naming_what_differs(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "study.journal"))
    specs = []
    for users in (4, 8):
        path = write_spec(tmp_path, workload={"args": {"system-tokens": 200}, "users": users})
        spec = load_spec(path)
        base = path.parent.joinpath(spec.base_profile).read_text()
        specs.append(StoredSpec("", base, fingerprint(spec.model_dump(mode="json"), base)))
    SharedStudy.create_or_join(storage, "shared", specs[0])
    SharedStudy.create_or_join(storage, "shared", specs[0])  # the same spec joins
    with pytest.raises(ConfigError, match=r"study 'shared' holds another sweep's spec \(its workload differ"):
        SharedStudy.create_or_join(storage, "shared", specs[1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--join", "nope", "--storage", "{tmp}/study.journal"],
            "--join nope: no such study in this storage",
        ),
        (["--join", "nope"], "--join nope: give --storage URL"),
        (
            ["--storage", "{tmp}/missing/study.journal", "--join", "x"],
            "the folder {tmp}/missing does not exist",
        ),
        (
            ["--storage", "postgresql://kvtune:hunter2@127.0.0.1:9/db", "--join", "x"],
            "the URL holds a password",
        ),
        (
            [
                "--storage",
                "postgresql://kvtune@127.0.0.1:9/db?sslmode=require&password=hunter2",
                "--join",
                "x",
            ],
            "--storage: the URL's query sets 'password', a credential; remove it",
        ),
        (
            ["--storage", "postgresql://kvtune@127.0.0.1:9/db", "--join", "x"],
            "postgresql://kvtune@127.0.0.1:9/db: cannot open it",
        ),
        (["--storage", "ftp://host/x", "--join", "x"], "ftp:// is not a storage kvtune knows"),
        (
            ["--resume", "{tmp}", "--storage", "{tmp}/s.journal"],
            "--resume RUN_DIR finds a study's storage in the run folder",
        ),
    ],
)
def test_bad_storage_and_join_exit_2_naming_the_flag(tmp_path: Path, args: list[str], message: str) -> None:
    words = [arg.format(tmp=tmp_path) for arg in args]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "sweep", *words, "--runs-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message.format(tmp=tmp_path) in " ".join(done.stderr.split()), done.stderr
    assert "hunter2" not in done.stderr + done.stdout
    assert time.monotonic() - started < 60
    assert not [p for p in tmp_path.iterdir() if p.is_dir()], "no run folder left behind"


def test_a_password_is_never_shown() -> None:
    assert shown_url("postgresql://kvtune:hunter2@db:5432/sweeps") == "postgresql://kvtune@db:5432/sweeps"
    shown = shown_url("postgresql://kvtune@db/sweeps?sslmode=require&password=hunter2#x")
    assert shown == "postgresql://kvtune@db/sweeps?sslmode=require"
    assert "hunter2" not in shown_url("postgresql://kvtune:x/hunter2@db/sweeps")  # SQLAlchemy's password


def test_a_worker_s_run_folder_resumes_by_joining_its_study_again(tmp_path: Path) -> None:
    """The CLI records where its study is (study.json, no password); `--resume RUN` joins it again in the
    same folder. The study's configs are measured by a scripted worker first, so the CLI measures none."""
    spec, storage, runs = write_spec(tmp_path), tmp_path / "study.journal", tmp_path / "runs"
    runs.mkdir()
    finish(worker(storage, runs, 0.0, "--spec", str(spec)))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvtune.cli", "sweep", *args], capture_output=True, text=True, timeout=300,
            cwd=ROOT,
        )  # fmt: skip

    joined = cli("--join", "shared", "--storage", str(storage), "--runs-dir", str(runs))
    assert joined.returncode == 0, joined.stderr
    (run,) = [p for p in runs.iterdir() if (p / "study.json").is_file() and not p.is_symlink()]
    assert json.loads((run / "study.json").read_text()) == {"storage": str(storage), "study": "shared"}
    resumed = cli("--resume", str(run))
    assert resumed.returncode == 0, resumed.stderr
    assert "study shared in" in resumed.stderr and "| Worker |" in (run / "report.md").read_text()
    folders = [p for p in runs.iterdir() if (p / "study.json").is_file() and not p.is_symlink()]
    assert folders == [run], "the same folder, resumed"
