"""`kvtune sweep` end to end on real engines: an engine that cannot start, Ctrl-C mid-trial, --resume, and a
report whose explanation of a KV-pressure miss is the engine's own preemptions.

One sweep covers it all (engine starts dominate the cost). The grid, in run order:
  1, 2  max_num_batched_tokens 256 without chunked prefill: vLLM refuses it (below max_model_len 384)
  3     1024 tokens, 64 KV blocks: serves the load comfortably
  4     1024 tokens, 14 KV blocks of 32 (13 usable): two ~260-token prompts fit (6 shared blocks + 3 each),
        their 64-token answers do not (5 each), so running requests are preempted
The sweep is interrupted during trial 4's load, then resumed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from kvtune.profile import load_profile
from kvtune.sweep import run_dir
from tests.conftest import ARTIFACTS, DEFAULT_PROFILE

pytestmark = pytest.mark.engine

SPEC = {
    "name": "real",
    "base_profile": str(DEFAULT_PROFILE),
    "space": {
        "max_model_len": [384],
        "block_size": [32],
        "enable_chunked_prefill": [False],
        "max_num_batched_tokens": [256, 1024],
        "num_gpu_blocks_override": [64, 14],
    },
    "prune_by_kv": False,  # trial 4 is meant to run under KV pressure
    "workload": {
        "name": "shared_prefix",
        "args": {"system-tokens": 200, "user-tokens": 50},
        "max_tokens": 64,
        "users": 6,
    },
    "slo": {"ttft_p99_s": 5.0},
    "load": {
        "start_rate": 0.25,
        "max_rate": 0.25,
        "bisect_steps": 0,
        "step_seconds": 20,
        "warmup_seconds": 2,
    },
}


def sweep(*args: str, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvtune.cli", "sweep", *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def trial_folder(run: Path, number: int) -> Path | None:
    found = sorted((run / "trials").glob(f"{number:03d}-*"))
    return found[0] if found else None


def wait_for(predicate: object, proc: subprocess.Popen[bytes], log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert callable(predicate)
        if predicate():
            return
        assert proc.poll() is None, f"sweep exited early: {log.read_text()[-3000:]}"
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:]}")


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line contains `text` (an engine's port, a trial folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if text in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE and proc.pid != os.getpid():
            found.append(proc)
    return found


def test_infeasible_interrupt_resume_and_the_report_explains_preemptions(tmp_path: Path) -> None:
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(SPEC))
    runs = tmp_path / "runs"
    log = ARTIFACTS / "sweep-real.log"
    ARTIFACTS.mkdir(exist_ok=True)

    # --- first run: interrupted while trial 4 is under load ---
    proc = sweep(str(spec_path), "--runs-dir", str(runs), log=log)
    try:
        latest = runs / "real-latest"
        wait_for(latest.exists, proc, log, 30, "the run folder")
        run = latest.resolve()

        def trial_4_under_load() -> bool:
            folder = trial_folder(run, 4)
            return folder is not None and any(folder.glob("kvtune-load-*/*.started"))

        wait_for(trial_4_under_load, proc, log, 600, "trial 4's load")
        folder_4 = trial_folder(run, 4)
        assert folder_4 is not None
        engine_port = str(load_profile(folder_4 / "profile.yaml").port)
        assert processes_mentioning(f"--port {engine_port}"), "trial 4's engine should be running"
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code == 130, output[-3000:]
    assert f"kvtune sweep --resume {run}" in " ".join(output.split())
    # Ctrl-C stopped trial 4's engine (all its processes) and its Locust processes.
    assert processes_mentioning(f"--port {engine_port}") == []
    assert processes_mentioning(str(folder_4)) == []

    finished = {r.trial: r for r in run_dir.finished_trials(run)}
    assert sorted(finished) == [1, 2, 3]
    for number in (1, 2):
        assert finished[number].status == "infeasible"
        assert "max_num_batched_tokens (256) is smaller than max_model_len (384)" in (
            finished[number].reason or ""
        )
    assert finished[3].status == "done" and finished[3].goodput == 0.25
    kept = {n: trial_folder(run, n) for n in (1, 2, 3)}
    mtimes = {n: max(p.stat().st_mtime for p in folder.iterdir()) for n, folder in kept.items() if folder}
    assert json.loads((run / run_dir.SUMMARY_FILE).read_text())["finished"] is False

    # --- resume: only trial 4's config runs again, in a new folder ---
    resume_log = ARTIFACTS / "sweep-real-resume.log"
    resumed = sweep("--resume", str(run), log=resume_log)
    try:
        assert resumed.wait(timeout=600) == 0, resume_log.read_text()[-3000:]
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
            resumed.wait()
    for number, folder in kept.items():
        assert folder is not None
        assert max(p.stat().st_mtime for p in folder.iterdir()) == mtimes[number], f"trial {number} was rerun"
    records = run_dir.finished_trials(run)
    assert [r.trial for r in records] == [1, 2, 3, 5]  # folder 4 stays as it was interrupted
    pressured = records[-1]
    assert pressured.knobs["num_gpu_blocks_override"] == 14
    assert pressured.status == "done" and pressured.goodput == 0.0
    step = pressured.steps[0]
    assert step.result.engine.preemptions > 0, "13 usable blocks for two growing requests must preempt"

    summary = json.loads((run / run_dir.SUMMARY_FILE).read_text())
    assert summary["finished"] is True
    assert summary["best"]["config_id"] == records[2].config_id
    # The report ties the KV-pressured trial's miss to its preemptions, with the engine's count.
    report = (run / "report.md").read_text()
    miss_rows = [line for line in report.splitlines() if line.startswith(f"| `{pressured.config_id}`")]
    assert any(f"{step.result.engine.preemptions:,.0f} preemptions" in row for row in miss_rows), report
    best = load_profile(run / "best.yaml")
    assert best.num_gpu_blocks_override == 64 and best.max_num_batched_tokens == 1024
    assert (run / "values.yaml").is_file() and (run / "report.html").is_file()
