"""The locustfiles on a real engine: each runs headless and reports TTFT and ITL rows next to its requests."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.engine import Engine
from tests.conftest import REPO

pytestmark = pytest.mark.engine

LOCUST = Path(sys.executable).with_name("locust")
SMALL = {  # sizes that keep a 2-core CPU run short
    "shared_prefix": ["--system-tokens", "128", "--user-tokens", "32"],
    "long_doc_qa": ["--num-docs", "2", "--doc-tokens", "256", "--question-tokens", "16"],
    "multi_turn": ["--turns", "3", "--turn-tokens", "48"],
    "replay": [],
}


def run_locust(
    locustfile: str, host: str, *extra: str, seconds: int = 15, users: int = 2
) -> subprocess.CompletedProcess[str]:
    argv = [str(LOCUST), "-f", str(REPO / "loadtests" / f"{locustfile}.py"), "--host", host, "--headless",
            "-u", str(users), "-r", str(users), "-t", f"{seconds}s", "--max-tokens", "8",
            "--stop-timeout", "120", *extra]  # fmt: skip
    # --stop-timeout: requests in flight when the time is up still finish and count, however slow the host.
    return subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 360, check=False, cwd=REPO)


def replay_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"prompt": "The three primary colours are", "max_tokens": 6},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.parametrize("workload", list(SMALL))
def test_locustfile_reports_ttft_and_itl_rows(workload: str, default_engine: Engine, tmp_path: Path) -> None:
    extra = SMALL[workload] + (["--replay-file", str(replay_file(tmp_path))] if workload == "replay" else [])
    prefix = tmp_path / "run"
    result = run_locust(workload, default_engine.url, *extra, "--csv", str(prefix))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "prefix-cache reuse: target" in result.stderr  # the run reports target vs engine hit rate
    with (tmp_path / "run_stats.csv").open() as handle:
        rows = {row["Type"]: row for row in csv.DictReader(handle) if row["Name"] == workload}
    assert set(rows) == {"POST", "TTFT", "ITL"}, rows
    for row in rows.values():
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
    # The first token comes before the whole answer; tokens come faster than whole answers.
    assert float(rows["TTFT"]["Median Response Time"]) <= float(rows["POST"]["Median Response Time"])
    assert float(rows["ITL"]["Average Response Time"]) < float(rows["POST"]["Average Response Time"])


def test_step_shape_adds_users_in_steps(default_engine: Engine, tmp_path: Path) -> None:
    argv = [str(LOCUST), "-f", f"{REPO}/loadtests/shared_prefix.py,{REPO}/loadtests/step_shape.py",
            "--host", default_engine.url, "--headless", "--max-tokens", "4", *SMALL["shared_prefix"],
            "--step-users", "1", "--step-seconds", "6", "--steps", "3",
            "--csv", str(tmp_path / "step"), "--csv-full-history"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    with (tmp_path / "step_stats_history.csv").open() as handle:
        users = [int(row["User Count"]) for row in csv.DictReader(handle)]
    levels = sorted(set(users) - {0})
    assert levels == [1, 2, 3], users
    assert users.index(2) < users.index(3)
    assert "Shape test stopping" in result.stderr


def test_kvtune_load_cli_prints_and_writes_the_result(default_engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    argv = [sys.executable, "-m", "kvtune.cli", "load", "--url", default_engine.url, "--users", "2",
            "--duration", "15", "--warmup", "2", "--max-tokens", "4", "--arg", "system-tokens=128",
            "--arg", "user-tokens=32", "--json", str(out)]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "TTFT" in result.stdout and "ITL" in result.stdout and "engine hit rate" in result.stdout
    data = json.loads(out.read_text())
    assert data["requests"] > 0 and data["ttft"]["p50"] > 0 and data["engine"]["prefix_cache_queries"] > 0
