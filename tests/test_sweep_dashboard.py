"""`kvtune sweep --dashboard PORT`: the sweep's study live in optuna-dashboard on 127.0.0.1, opened in real
Chromium: the study's trials are listed with kvtune's attributes (goodput, SLO verdict, config, worker).

The study is filled by scripted workers (tests/study_worker.py); one of them holds the last config, so the
`kvtune sweep --join` under test has nothing to claim and waits with its dashboard up, as a worker does
while others measure. No engine starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvtune.engine import free_port
from kvtune.sweep.study import open_storage
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
            with open_browser() as page:
                page.open(url)
                page.wait_for_text("shared")  # the study, listed by name
                study_id = open_storage(str(storage)).get_study_id_from_name("shared")
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
