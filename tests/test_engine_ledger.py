"""The engine-start ledger without engines: a `python -c` process whose argv has a vLLM server's shape is
counted as one, anything else is not, the sitecustomize never fails a process and runs the one it shadows,
and the session's summary counts per test file and per configuration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers_ledger import (
    LEDGER_ENV,
    LEDGER_SITE,
    OUTSIDE_A_TEST,
    EngineStart,
    read_ledger,
    summary_lines,
)

SERVER = ["-m", "vllm.entrypoints.openai.api_server"]
FLAGS = ["--model", "/cache/smollm2-135m", "--served-model-name", "smollm2-135m", "--host", "127.0.0.1"]
TEST = "tests/test_engine_real.py::test_answers_capital_of_france (setup)"


def python(
    *argv: str, ledger: Path | None, test: str = TEST, path: list[Path] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -c pass ARGV...` as a test's child: the ledger's site folder (then PATH) on PYTHONPATH.

    The session's own ledger is never named: these processes would count as its engine starts."""
    env = {k: v for k, v in os.environ.items() if k not in (LEDGER_ENV, "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in [LEDGER_SITE, *(path or [])])
    env["PYTEST_CURRENT_TEST"] = test
    if ledger is not None:
        env[LEDGER_ENV] = str(ledger)
    argv_run = [sys.executable, "-c", "pass", *argv]
    return subprocess.run(argv_run, env=env, capture_output=True, text=True, timeout=60, check=False)


def test_a_vllm_server_start_is_one_line_with_its_test_and_flags(tmp_path: Path) -> None:
    ledger = tmp_path / "starts.jsonl"
    result = python(*SERVER, *FLAGS, "--port", "8123", ledger=ledger)
    assert (result.returncode, result.stderr) == (0, "")
    (line,) = ledger.read_text().splitlines()
    record = json.loads(line)
    assert record["test"] == TEST and record["flags"] == [*FLAGS, "--port", "8123"]
    (start,) = read_ledger(ledger)
    assert start.test_file == "tests/test_engine_real.py"
    assert start.configuration == " ".join(
        ["--model", "smollm2-135m", "--served-model-name", "smollm2-135m", "--host", "127.0.0.1"]
    )


def test_other_processes_write_nothing(tmp_path: Path) -> None:
    ledger = tmp_path / "starts.jsonl"
    for argv in (["-m", "kvtune.cli", "up", "p.yaml"], ["--model", "x"], []):
        assert python(*argv, ledger=ledger).returncode == 0
    assert not ledger.exists()


def test_no_ledger_named_or_one_that_cannot_be_written_never_fails_the_process(tmp_path: Path) -> None:
    assert python(*SERVER, *FLAGS, ledger=None).stderr == ""
    result = python(*SERVER, *FLAGS, ledger=tmp_path)  # a folder: open() fails
    assert (result.returncode, result.stderr) == (0, "")


def test_the_sitecustomize_it_shadows_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "other-site"
    other.mkdir()
    ran = tmp_path / "ran"
    (other / "sitecustomize.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    ledger = tmp_path / "starts.jsonl"
    assert python(*SERVER, *FLAGS, ledger=ledger, path=[other]).returncode == 0
    assert ran.exists() and len(read_ledger(ledger)) == 1


def test_the_session_counts_its_engine_starts() -> None:
    assert os.environ[LEDGER_ENV].endswith("engine-starts.jsonl")
    assert str(LEDGER_SITE) in os.environ["PYTHONPATH"].split(os.pathsep)


def test_a_line_cut_short_is_skipped(tmp_path: Path) -> None:
    ledger = tmp_path / "starts.jsonl"
    whole = json.dumps({"time": 2.0, "pid": 1, "test": "", "flags": ["--port", "1"]})
    ledger.write_text(f'{whole}\n{{"time": 1.0, "te\n')
    (start,) = read_ledger(ledger)
    assert start.test_file == OUTSIDE_A_TEST and start.configuration == ""
    assert read_ledger(tmp_path / "missing.jsonl") == []


def start(test: str, port: int, *flags: str) -> EngineStart:
    return EngineStart(float(port), test, ("--model", "/m/smollm2-135m", "--port", str(port), *flags))


def test_the_summary_counts_per_test_file_and_per_configuration_less_ports() -> None:
    events = '{"enable_kv_cache_events":true,"endpoint":"tcp://127.0.0.1:%d","topic":"kv@smol"}'
    starts = [
        start("tests/test_a.py::test_x (setup)", 8001),
        start("tests/test_a.py::test_y (call)", 8002),
        start("tests/test_b.py::test_z (call)", 8003, "--kv-events-config", events % 5601),
        start("tests/test_b.py::test_z (call)", 8004, "--kv-events-config", events % 5602),
        start("tests/test_b.py::test_w (call)", 8005, "--enforce-eager"),
    ]
    lines = summary_lines(starts, wall_s=125.4)
    assert lines[0] == "5 engine starts; session wall time 2m05s"
    per_file = lines[lines.index("per test file:") + 1 : lines.index("per configuration (flags less ports):")]
    assert per_file == ["    3  tests/test_b.py", "    2  tests/test_a.py"]
    per_config = lines[lines.index("per configuration (flags less ports):") + 1 :]
    assert per_config == [
        "    2  --model smollm2-135m",
        "    2  --model smollm2-135m --kv-events-config " + events.replace("%d", "PORT"),
        "    1  --model smollm2-135m --enforce-eager",
    ]
    assert summary_lines([], wall_s=9) == ["0 engine starts; session wall time 9s"]
