"""The locustfiles on a real engine: each runs headless, counts only its POST requests as requests, and
reports TTFT and ITL in a file of their own and its prefix-cache reuse in figures the engine's counters match.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune import metrics
from kvtune.engine import Engine
from tests.helpers import REPO
from tests.helpers_locust import LOCUST, run_locust

pytestmark = pytest.mark.engine

SMALL = {  # sizes that keep a 2-core CPU run short
    "shared_prefix": ["--system-tokens", "128", "--user-tokens", "32"],
    "long_doc_qa": ["--num-docs", "2", "--doc-tokens", "256", "--question-tokens", "16"],
    "multi_turn": ["--turns", "3", "--turn-tokens", "48"],
    "replay": [],
}
# The share of prompt tokens each design makes reusable at those sizes.
TARGET = {
    "shared_prefix": 128 / (128 + 32),
    "long_doc_qa": 256 / (256 + 16),
    "multi_turn": (0 + 1 + 2) * 48 / ((0 + 1 + 2) * 48 + 3 * 48),  # turn k resends k-1 earlier turns
    "replay": None,
}
REUSE_LINE = re.compile(
    r"prefix-cache reuse: target (?:(?P<target>[\d.]+)%|not set by this workload), engine hit rate "
    r"(?:(?P<rate>[\d.]+)% \((?P<hits>\d+) of (?P<queries>\d+) prompt tokens\)|no prompts)"
)


def replay_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"prompt": "The three primary colours are", "max_tokens": 6},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def reuse_counters(url: str) -> tuple[float, float]:
    samples = metrics.scrape(url)
    return metrics.total(samples, metrics.PREFIX_CACHE_HITS), metrics.total(
        samples, metrics.PREFIX_CACHE_QUERIES
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.parametrize("workload", list(SMALL))
def test_locustfile_counts_requests_and_reports_ttft_itl_and_reuse(
    workload: str, default_engine: Engine, tmp_path: Path
) -> None:
    extra = SMALL[workload] + (["--replay-file", str(replay_file(tmp_path))] if workload == "replay" else [])
    prefix = tmp_path / "run"
    hits_before, queries_before = reuse_counters(default_engine.url)
    result = run_locust(
        workload, default_engine.url, *extra, "--csv", str(prefix), "--json-file", str(prefix)
    )
    hits_after, queries_after = reuse_counters(default_engine.url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr

    # Locust's statistics hold requests only: the Aggregated row is the POST row.
    stats = {(row["Type"], row["Name"]): row for row in read_csv(tmp_path / "run_stats.csv")}
    assert set(stats) == {("POST", workload), ("", "Aggregated")}, stats
    post = stats[("POST", workload)]
    assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0, post
    assert stats[("", "Aggregated")]["Request Count"] == post["Request Count"]

    # Locust's final JSON (written after the last request; its CSV may be a second older): requests only.
    (final,) = json.loads((tmp_path / "run.json").read_text())
    assert (final["method"], final["name"], final["num_failures"]) == ("POST", workload, 0), final

    # TTFT and ITL in their own file: one TTFT per request; tokens come faster than whole answers.
    timings = {
        row["Type"]: row for row in read_csv(tmp_path / "run_token_latency.csv") if row["Name"] == workload
    }
    assert set(timings) == {"TTFT", "ITL"}, timings
    assert int(timings["TTFT"]["Samples"]) == final["num_requests"]
    assert int(timings["ITL"]["Samples"]) > 0
    assert float(timings["TTFT"]["Median (ms)"]) <= float(post["Median Response Time"])
    assert float(timings["ITL"]["Average (ms)"]) < float(post["Average Response Time"])
    as_json = {row["method"]: row for row in json.loads((tmp_path / "run_token_latency.json").read_text())}
    assert as_json["TTFT"]["samples"] == int(timings["TTFT"]["Samples"])

    # The reuse line: the design's target, and the engine's own counters over the run.
    (line,) = [m for m in map(REUSE_LINE.search, result.stderr.splitlines()) if m]
    target = TARGET[workload]
    if target is None:
        assert line["target"] is None
    else:
        assert float(line["target"]) == pytest.approx(100 * target, abs=0.05)
    assert line["queries"] is not None and line["hits"] is not None and line["rate"] is not None, line[0]
    assert int(line["queries"]) == queries_after - queries_before > 0
    assert int(line["hits"]) == hits_after - hits_before
    assert float(line["rate"]) == pytest.approx(100 * int(line["hits"]) / int(line["queries"]), abs=0.05)
    if target is not None:
        # The engine reused part of what the design shares, never more (whole blocks of it are cached).
        assert 0 < float(line["rate"]) <= 100 * target + 5, line[0]


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


def test_a_loadtests_file_runs_a_single_user_as_a_script(default_engine: Engine) -> None:
    """`python loadtests/x.py` runs run_single_user: one user, each request printed, until --run-for."""
    argv = [sys.executable, str(REPO / "loadtests" / "shared_prefix.py"), "--host", default_engine.url,
            "--run-for", "4", "--max-tokens", "4", *SMALL["shared_prefix"]]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert any(line.split()[:2] == ["POST", "shared_prefix"] for line in result.stdout.splitlines()), (
        result.stdout
    )
