"""`kvtune sweep --dashboard PORT`: the sweep's study live in optuna-dashboard on 127.0.0.1, opened in real
Chromium: the study's trials are listed with kvtune's attributes (goodput, SLO verdict, config, worker).
The dashboard is read-only unless `--dashboard-writable`: real HTTP requests that would change the study
(DELETE, POST, PUT, PATCH, any method but GET and HEAD) are refused and the study stays.

The study is filled by scripted workers (tests/study_worker.py); one of them holds the last config, so the
`kvtune sweep --join` under test has nothing to claim and waits with its dashboard up, as a worker does
while others measure. No engine starts.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optuna.storages import BaseStorage

from kvtune.engine import free_port
from kvtune.sweep import dashboard
from kvtune.sweep.spec import load_spec
from kvtune.sweep.study import SharedStudy, StoredSpec, open_storage
from tests.browser import open_browser
from tests.helpers import ARTIFACTS
from tests.test_sweep_study import ROOT, worker, write_spec


def test_the_sweep_serves_its_study_in_optuna_dashboard(tmp_path: Path) -> None:
    spec, storage, runs = write_spec(tmp_path), tmp_path / "study.journal", tmp_path / "runs"
    runs.mkdir()
    holder = worker(storage, runs, 0.1, "--spec", str(spec), "--hang-after", "3")
    try:
        deadline = time.monotonic() + 60
        while len(list(runs.glob("claimed-*"))) < 4:  # three measured, the fourth held
            assert time.monotonic() < deadline and holder.poll() is None, "the scripted worker stalled"
            time.sleep(0.2)
        port = free_port("127.0.0.1")
        log = tmp_path / "sweep.log"
        sweep = subprocess.Popen(
            [sys.executable, "-m", "kvtune.cli", "sweep", "--join", "shared", "--storage", str(storage),
             "--dashboard", str(port), "--runs-dir", str(runs)],
            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}/dashboard/"
            deadline = time.monotonic() + 60
            while f"optuna-dashboard: {url}" not in log.read_text():
                assert time.monotonic() < deadline and sweep.poll() is None, log.read_text()
                time.sleep(0.2)
            assert "read-only" in log.read_text() and "--dashboard-writable" in log.read_text()
            study_id = open_storage(str(storage)).get_study_id_from_name("shared")
            status, _ = request(port, "DELETE", f"/api/studies/{study_id}")
            assert status == 405, "the shared study cannot be deleted through the dashboard"
            with open_browser() as page:
                page.open(url)
                page.wait_for_text("shared")  # the study, listed by name
                page.open(f"{url}studies/{study_id}/trials")
                page.wait_for_text("goodput_req_s")
                text = page.text()
                page.screenshot(ARTIFACTS / "optuna-dashboard-trials.png")
            for attribute in ("met_slo", "config", "worker", "hit_rate", "preemptions", "peak_kv_usage"):
                assert attribute in text, attribute
            assert f"{os.uname().nodename}:{holder.pid}" in text, "each trial's worker"
        finally:
            os.killpg(sweep.pid, signal.SIGINT)
            assert sweep.wait(timeout=60) == 130, log.read_text()  # interrupted while it waited
    finally:
        holder.kill()
        holder.wait()
    assert "Traceback" not in log.read_text()


def request(
    port: int, method: str, path: str, body: bytes = b"", host: str | None = None
) -> tuple[int, bytes]:
    """One real HTTP request to 127.0.0.1:PORT: its status and body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        headers = {"Content-Type": "application/json"} | ({"Host": host} if host else {})
        connection.request(method, path, body=body or None, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture
def shared_storage(tmp_path: Path) -> Iterator[BaseStorage]:
    """A journal holding the study `shared`, with one trial claimed."""
    spec_path = write_spec(tmp_path)
    study = SharedStudy.create_or_join(
        open_storage(str(tmp_path / "study.journal")),
        "shared",
        StoredSpec.of(load_spec(spec_path), spec_path),
    )
    assert study.claim({"max_num_seqs": 2, "max_model_len": 1024}) is not None
    yield study.storage


# What optuna-dashboard 0.21 lets a caller change, each by its method and path.
WRITES = [
    ("DELETE", "/api/studies/{id}", b""),
    ("POST", "/api/studies", b'{"study_name": "new", "directions": ["maximize"]}'),
    ("POST", "/api/studies/{id}/rename", b'{"study_name": "renamed"}'),
    ("PUT", "/api/studies/{id}/note", b'{"version": 0, "body": "x"}'),
    ("POST", "/api/trials/0/tell", b'{"state": "Fail"}'),
    ("POST", "/api/trials/0/user-attrs", b'{"user_attrs": {"k": "v"}}'),
    ("PUT", "/api/studies/{id}/0/note", b'{"version": 0, "body": "x"}'),
    ("PATCH", "/api/studies/{id}", b"{}"),
    ("POST", "/incompatible-rdb-schema", b""),
    ("delete", "/api/studies/{id}", b""),
]
METHODS = st.one_of(
    st.sampled_from(
        ["POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT", "PROPFIND", "post", "Delete"]
    ),
    st.from_regex(r"[A-Za-z]{3,10}", fullmatch=True).filter(
        lambda m: m.upper() not in dashboard.READ_METHODS
    ),
)


def test_the_dashboard_is_read_only_by_default(shared_storage: BaseStorage) -> None:
    study_id = shared_storage.get_study_id_from_name("shared")
    before = shared_storage.get_all_studies()
    with dashboard.serving(shared_storage, 0) as url:
        port = int(url.split(":")[2].split("/")[0])
        for method, path, body in WRITES:
            status, answer = request(port, method, path.format(id=study_id), body)
            assert status == 405, (method, path, status, answer)
            assert b"--dashboard-writable" in answer
        status, answer = request(port, "GET", "/api/studies")
        assert status == 200 and [s["study_name"] for s in json.loads(answer)["study_summaries"]] == [
            "shared"
        ]
        assert request(port, "GET", f"/api/studies/{study_id}")[0] == 200
        assert request(port, "HEAD", "/dashboard/")[0] == 200
        assert request(port, "GET", "/api/studies", host="evil.example:80")[0] == 403  # DNS rebinding
    after = shared_storage.get_all_studies()
    assert [(s.study_name, s.system_attrs, s.user_attrs) for s in after] == [
        (s.study_name, s.system_attrs, s.user_attrs) for s in before
    ]
    assert len(shared_storage.get_all_trials(study_id)) == 1


def test_any_method_but_get_and_head_is_refused(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "study.journal"))
    storage.create_new_study([], "kept")
    with dashboard.serving(storage, 0) as url:
        port = int(url.split(":")[2].split("/")[0])

        @settings(max_examples=60, deadline=None)
        @given(
            method=METHODS,
            path=st.sampled_from(["/api/studies/0", "/api/studies", "/api/trials/0/tell", "/"]),
        )
        def refused(method: str, path: str) -> None:
            status, _ = request(port, method, path, b"{}")
            assert status == 405, (method, path)
            assert [s.study_name for s in storage.get_all_studies()] == ["kept"]

        refused()


def test_writable_opens_the_writes_and_says_so(shared_storage: BaseStorage) -> None:
    study_id = shared_storage.get_study_id_from_name("shared")
    assert "WRITABLE" in dashboard.access_note(True) and "delete" in dashboard.access_note(True)
    assert "read-only" in dashboard.access_note(False)
    with dashboard.serving(shared_storage, 0, writable=True) as url:
        port = int(url.split(":")[2].split("/")[0])
        assert request(port, "DELETE", f"/api/studies/{study_id}", host="evil.example")[0] == 403
        status, _ = request(port, "DELETE", f"/api/studies/{study_id}")
    assert status == 204
    assert shared_storage.get_all_studies() == []
