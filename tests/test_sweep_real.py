"""`kvtune sweep` end to end on real engines: an engine that cannot start, Ctrl-C mid-trial, --resume, and a
report whose explanation of a KV-pressured config is the engine's own preemptions.

One sweep covers it all (engine starts dominate the cost). The grid, in run order:
  1, 2  max_num_batched_tokens 256 without chunked prefill: vLLM refuses it (below max_model_len 384)
  3     1024 tokens, 64 KV blocks (63 usable): six ~200-token prompts with 120-token answers fit at once
        (4 shared blocks + 6 each)
  4     1024 tokens, 14 KV blocks of 32 (13 usable): three ~200-token prompts fit (4 shared blocks + 3 each),
        but two 120-token answers do not (6 each), so two requests in flight at once preempt one another
The sweep is interrupted during trial 4's load, then resumed. The fp8 quality gate is off: on a host that
keeps fp8 KV it would start a 16-bit reference engine first (test_quality_gate_real covers the gate).

Whether a config meets the latency SLO depends on how fast the host is, so the goodputs and the winner are
not asserted; what the KV arithmetic decides is: no preemption in trial 3, preemptions in the pressured
config, and a report that shows and explains them. The arrivals are seeded: at 0.25 req/s, seed 3 sends
three requests within 0.4 s of each other mid-window (12.6, 12.9 and 13.0 s), while the load stays light
for trial 3. An answer is 120 engine steps (EOS ignored) after its prefill, and one vLLM step takes
milliseconds even on the fastest CPU, so those requests overlap however fast the host is; the test checks
from the trial's own samples that they did before it reads the preemptions.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.profile import load_profile
from kvtune.sweep import run_dir
from kvtune.sweep.records import TrialRecord
from tests.helpers import ARTIFACTS, vllm_keeps_fp8_kv, write_test_profile

pytestmark = pytest.mark.engine

SPEC: dict[str, Any] = {
    "name": "real",
    "space": {
        "max_model_len": [384],
        "block_size": [32],
        "enable_chunked_prefill": [False],
        "max_num_batched_tokens": [256, 1024],
        "num_gpu_blocks_override": [64, 14],
    },
    "envelope": {"max_model_len": 384},  # short prompts: the pressured pools hold them
    "validation": {"enabled": False},  # tests/test_validation_real.py measures it
    "prune_by_kv": False,  # trial 4 is meant to run under KV pressure
    "quality": {"enabled": False},
    # Trial numbers and engine starts are asserted below; the drift check (tests/test_sweep_drift.py) would
    # add a sentinel engine and possibly a repeat.
    "drift_check": False,
    "workload": {
        "name": "shared_prefix",
        # The envelope check allows 64 tokens for the chat template: 150 + 40 + 120 + 64 = 374 <= 384.
        "args": {"system-tokens": 150, "user-tokens": 40},
        "max_tokens": 120,
        "users": 6,
    },
    # A median at 95% needs 5 requests to pass: about what a 20-s step at 0.25 req/s holds (one with
    # fewer is measured a little longer). A p99 could not pass on so few: the verdicts would be undecided.
    # So could the default 1% error share (about 300 requests without an error): a lax one is decided on
    # the same 5, and an undecided step stops at 40 s (the default cap is four times the step).
    "slo": {"ttft_p50_s": 5.0, "max_error_rate": 0.5},
    "seed": 3,  # the arrival schedule named above
    "load": {
        "start_rate": 0.25,
        "max_rate": 0.25,
        "rate_cap": 0.25,
        "bisect_steps": 0,
        "step_seconds": 20,
        "warmup_seconds": 2,
        "max_step_seconds": 40,
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


STEPS_SECTION = "Load steps: samples, bounds and verdicts (why a step did not pass)"


def table_row(report: str, section: str, config_id: str) -> dict[str, str] | None:
    """The row of `config_id` in a Markdown table of the report, by column title; None when absent."""
    lines = report.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0].splitlines()
    table = [line for line in lines if line.startswith("|")]
    if not table:
        return None

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]

    titles = cells(table[0])
    for line in table[2:]:
        row = dict(zip(titles, cells(line), strict=True))
        if row["Config"].strip("*") == f"`{config_id}`":
            return row
    return None


def max_in_flight(folder: Path | None) -> int:
    """The most requests a trial's load had in flight at once, from its per-request samples."""
    assert folder is not None
    records = [json.loads(line) for path in folder.glob("kvtune-load-*/samples.*.jsonl")
               for line in path.read_text().splitlines()]  # fmt: skip
    edges = sorted(edge for r in records for edge in ((r["sent"], 1), (r["intended"] + r["e2e"], -1)))
    running, most = 0, 0
    for _moment, change in edges:
        running += change
        most = max(most, running)
    return most


def preemptions(record: TrialRecord) -> float:
    return sum(step.result.engine.preemptions for step in record.steps)


def searched_as_planned(record: TrialRecord) -> None:
    """The ladder is one rate (rate_cap 0.25); a config that misses it is measured one rung below; a goodput
    was looked at twice (the second look on fresh arrivals), and each step says which look it is."""
    ladder = [0.25] if record.steps[0].passed else [0.25, 0.125]
    assert [step.rate for step in record.steps][: len(ladder)] == ladder
    assert record.steps[-1].sample == 2 or record.goodput == 0  # the search ends on a second look
    if record.goodput:
        assert [s.passed for s in record.steps if s.rate == record.goodput] == [True, True]
    samples_numbered(record)


def goodput_of(record: TrialRecord) -> float:
    """The highest rate at which every sample passed."""
    held = [s.rate for s in record.steps if all(o.passed for o in record.steps if o.rate == s.rate)]
    return max(held, default=0.0)


def samples_numbered(record: TrialRecord) -> None:
    """Each step says which sample at its rate it is: a second look at a rate is sample 2."""
    rates = [step.rate for step in record.steps]
    assert [step.sample for step in record.steps] == [rates[: i + 1].count(r) for i, r in enumerate(rates)]


def test_infeasible_interrupt_resume_and_the_report_explains_preemptions(tmp_path: Path) -> None:
    # The precondition of the preemption assertions: three seeded arrivals within 0.4 s, mid-window.
    schedule = ArrivalSchedule(SPEC["load"]["start_rate"], "poisson", start=1.0, seed=SPEC["seed"])
    offsets = [schedule.time_of(i) - 1.0 for i in range(8)]
    assert any(a > 4 and c - a < 0.4 and c < 18 for a, c in zip(offsets, offsets[2:], strict=False)), offsets
    spec_path = tmp_path / "sweep.yaml"
    base = write_test_profile(tmp_path / "base.yaml")
    spec_path.write_text(yaml.safe_dump(SPEC | {"base_profile": str(base)}))
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
    unpressured = finished[3]
    # The shipped profile's fp8 KV as this host runs it, by the engine's own report.
    assert unpressured.kv_capacity is not None
    assert unpressured.kv_capacity["cache_dtype"] == ("fp8" if vllm_keeps_fp8_kv() else "auto")
    assert unpressured.status == "done"
    searched_as_planned(unpressured)
    assert unpressured.goodput == goodput_of(unpressured)
    assert preemptions(unpressured) == 0, "63 usable blocks hold every request in flight: nothing to preempt"
    kept = {n: trial_folder(run, n) for n in (1, 2, 3)}
    mtimes = {n: max(p.stat().st_mtime for p in folder.iterdir()) for n, folder in kept.items() if folder}
    assert json.loads((run / run_dir.SUMMARY_FILE).read_text())["finished"] is False

    # --- resume: only trial 4's config runs again, in a new folder ---
    resume_log = ARTIFACTS / "sweep-real-resume.log"
    resumed = sweep("--resume", str(run), log=resume_log)
    try:
        code = resumed.wait(timeout=600)
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
    assert pressured.status == "done"
    searched_as_planned(pressured)
    step = pressured.steps[0]
    assert pressured.goodput == goodput_of(pressured)
    # The precondition the block arithmetic needs: two of its requests were in flight at once.
    assert max_in_flight(trial_folder(run, 5)) >= 2, "no two requests overlapped: nothing to preempt"
    count = step.result.engine.preemptions
    assert count > 0, "13 usable blocks for two growing requests must preempt"
    assert step.result.engine.kv_capacity is not None
    assert step.result.engine.kv_capacity["num_blocks"] == 14

    summary = json.loads((run / run_dir.SUMMARY_FILE).read_text())
    assert summary["finished"] is True
    # Exit code 0 exactly when a config met the SLO (which, on a slow host, none may): its files are written.
    best_id = summary["best"]["config_id"] if summary["best"] else None
    assert code == (0 if best_id else 1), resume_log.read_text()[-3000:]
    deployables = [run / name for name in ("best.yaml", "values.yaml", "vllm-serve.sh")]
    assert all(path.is_file() == (best_id is not None) for path in deployables)
    if best_id is not None:
        [winner] = [r for r in records if r.config_id == best_id]
        assert winner.goodput == max(r.goodput or 0.0 for r in records) > 0
        best = load_profile(run / "best.yaml")
        assert best.num_gpu_blocks_override == winner.knobs["num_gpu_blocks_override"]
        assert best.max_num_batched_tokens == winner.knobs["max_num_batched_tokens"] == 1024

    # The report shows the pressured config's preemptions with the engine's own count, and when its step
    # missed the SLO, puts them first among the reasons.
    report = (run / "report.md").read_text()
    assert (run / "report.html").is_file()
    row = table_row(report, "Configs", pressured.config_id)
    assert row is not None, report
    # The row's own step is its goodput step (one rung below when 0.25 missed); the worst step's count, the
    # 0.25 step's here, is shown beside it when higher.
    worst = max(s.result.engine.preemptions for s in pressured.steps)  # a second look may preempt more
    assert row["Status"].startswith("done") and f"{worst:,.0f}" in row["Preemptions"], row
    miss = table_row(report, STEPS_SECTION, pressured.config_id)
    assert miss is not None, report
    if step.passed:
        assert miss["Why (engine figures)"] == "—", miss
    else:
        assert miss["Why (engine figures)"].startswith(f"{count:,.0f} preemptions: the KV pool"), miss
    # Every step carries its sample and bound, in summary.json and in the report's steps table.
    for config in summary["configs"]:
        for verdict in config["steps"]:
            assert verdict["requests"] > 0 and verdict["windows"] >= 1, verdict
            assert verdict["decision"] in {"pass", "fail", "undecided"}, verdict
            judged = {v["name"]: v for v in verdict["verdicts"]}
            assert set(judged) == {"TTFT p50", "error rate"}, judged
            assert judged["TTFT p50"]["samples"] <= verdict["requests"], judged
            assert verdict["decision"] != "pass" or judged["TTFT p50"]["upper"] <= 5.0, judged
    assert f"{step.requests_due:,}" in miss["Requests"] and "samples" in miss["Bounds"], miss
    unpressured_row = table_row(report, "Configs", unpressured.config_id)
    assert unpressured_row is not None and unpressured_row["Preemptions"] == "0", unpressured_row
