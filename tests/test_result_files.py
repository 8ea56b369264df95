"""kvtune's own result files read back with bounds: Locust samples, trial and validation records.

Each is read by the one bounded reader of its kind (kvtune.loadgen.samples, kvtune.sweep.records.read_record):
generated damage (any bytes, a line past the bound, a file past the bound, a FIFO, a folder) is parsed or is
one error line naming the file, never another exception, a hang or a read of the whole file. `kvtune sweep
--resume` of a run whose record was damaged exits 2 with that line and no traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.config_errors import ConfigError, DocumentError
from kvtune.loadgen import samples
from kvtune.sweep import run_dir
from kvtune.sweep.records import MAX_RECORD_BYTES, TrialRecord, ValidationRecord, read_record
from kvtune.sweep.spec import load_spec
from kvtune.sweep.validation import RECORD_FILE, VALIDATION_DIR, finished_records
from tests.helpers import REPO
from tests.test_documents import without_blocking

SAMPLE = {"intended": 1.0, "ttft": 0.1, "e2e": 0.5, "itl": [0.01, 0.02], "error": None}
RECORD = TrialRecord(trial=1, config_id="abc", knobs={"max_num_seqs": 2}, status="done", goodput=1.0)


def _one_line(error: Exception, path: Path) -> str:
    text = str(error)
    assert "\n" not in text and text.startswith(str(path)), text
    return text


# ---- Locust samples ----------------------------------------------------------------------------------------


def test_samples_are_read_and_a_line_cut_by_a_stop_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "samples.1.jsonl"
    path.write_text(json.dumps(SAMPLE) + "\n" + json.dumps(SAMPLE) + "\n" + '{"intended": 2.0, "tt')
    assert samples.read_samples(path) == [SAMPLE, SAMPLE]
    assert samples.count_lines(path) == 2


def test_a_damaged_line_before_the_end_is_named(tmp_path: Path) -> None:
    path = tmp_path / "samples.1.jsonl"
    path.write_bytes(
        json.dumps(SAMPLE).encode() + b"\n\xff\xfe not json\n" + json.dumps(SAMPLE).encode() + b"\n"
    )
    with pytest.raises(DocumentError) as info:
        samples.read_samples(path)
    assert "line 2 is not a sample" in _one_line(info.value, path)


def test_a_line_past_the_bound_is_refused_without_reading_on(tmp_path: Path) -> None:
    path = tmp_path / "samples.1.jsonl"
    with path.open("wb") as out:
        out.write(b'{"itl": [' + b"0.01," * (samples.MAX_LINE_BYTES // 5 + 1))
    with pytest.raises(DocumentError) as info:
        samples.read_samples(path)
    assert "line 1 is longer than 4 MiB" in _one_line(info.value, path)


def test_a_file_past_the_bound_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    path = tmp_path / "samples.1.jsonl"
    path.touch()
    os.truncate(path, samples.MAX_FILE_BYTES + 1)  # sparse: reading it would take GBs of memory
    for read in (samples.read_samples, samples.count_lines):
        with pytest.raises(DocumentError) as info:
            read(path)
        assert "larger than the 2 GiB kvtune reads as a samples file" in _one_line(info.value, path)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_samples_path_that_is_not_a_file_is_refused_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "samples.1.jsonl"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    with pytest.raises(DocumentError) as info:
        without_blocking(lambda: samples.read_samples(path), unblock=path if kind == "fifo" else None)
    assert f"is a {'pipe' if kind == 'fifo' else 'folder'}" in _one_line(info.value, path)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lines=st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.just(json.dumps(SAMPLE).encode()),
            st.from_regex(rb"\A[\[\]{}\"0-9a-z:,. ]{0,40}\Z"),
        ),
        max_size=8,
    ),
    ended=st.booleans(),
)
def test_any_samples_file_is_read_or_named(tmp_path: Path, lines: list[bytes], ended: bool) -> None:
    path = tmp_path / "samples.1.jsonl"
    path.write_bytes(b"\n".join(lines) + (b"\n" if ended and lines else b""))
    try:
        records = samples.read_samples(path)
    except DocumentError as exc:
        assert " is not a sample (a JSON object); the file is damaged" in _one_line(exc, path)
        return
    assert all(isinstance(record, dict) for record in records)
    assert len(records) <= samples.count_lines(path) + 1


# ---- trial and validation records -------------------------------------------------------------------------


def _validation_file(run: Path) -> Path:
    path = run / VALIDATION_DIR / "winner" / "load" / RECORD_FILE
    path.parent.mkdir(parents=True)
    return path


def test_records_kvtune_wrote_read_back(tmp_path: Path) -> None:
    folder = tmp_path / "trials" / "001-abc-r1"
    run_dir.save_trial(folder, RECORD)
    assert run_dir.finished_trials(tmp_path) == [RECORD]
    validation = ValidationRecord(role="winner", label="abc", load="load", record=RECORD)
    _validation_file(tmp_path).write_text(validation.model_dump_json())
    assert finished_records(tmp_path) == {("abc", "load", 1): validation}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(st.binary(max_size=200), st.from_regex(rb"\A\{[\"a-z0-9:,\[\]{} ]{0,60}\}?\Z")))
def test_any_damaged_record_is_one_line_naming_it(tmp_path: Path, content: bytes) -> None:
    record = tmp_path / "trials" / "001-abc-r1" / run_dir.RESULT_FILE
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_bytes(content)
    validation = tmp_path / VALIDATION_DIR / "winner" / "load" / RECORD_FILE
    validation.parent.mkdir(parents=True, exist_ok=True)
    validation.write_bytes(content)
    for path, read in ((record, run_dir.finished_trials), (validation, finished_records)):
        with pytest.raises(ConfigError) as info:
            read(tmp_path)
        _one_line(info.value, path)


@pytest.mark.parametrize("schema", [TrialRecord, ValidationRecord])
def test_a_record_past_the_bound_is_refused_from_its_size(tmp_path: Path, schema: type) -> None:
    path = tmp_path / "record.json"
    path.touch()
    os.truncate(path, MAX_RECORD_BYTES + 1)
    with pytest.raises(ConfigError) as info:
        read_record(schema, path, "a trial record")
    assert "is larger than 256 MiB, the most kvtune reads as a trial record" in _one_line(info.value, path)


def test_a_fifo_in_place_of_a_validation_record_is_refused_at_once(tmp_path: Path) -> None:
    path = _validation_file(tmp_path)
    os.mkfifo(path)
    with pytest.raises(ConfigError) as info:
        without_blocking(lambda: finished_records(tmp_path), unblock=path)
    assert "is a pipe" in _one_line(info.value, path)


def test_resume_of_a_run_with_a_damaged_record_exits_2_naming_it(tmp_path: Path) -> None:
    spec = REPO / "deploy" / "sweeps" / "cpu-quick.yaml"
    run = run_dir.create(tmp_path / "runs", load_spec(spec), spec)
    damaged = run / "trials" / "001-abc-r1" / run_dir.RESULT_FILE
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b'{"trial": 1, "status": "done", "knobs": {}, "config_id": "abc", "steps": [{')
    result = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "sweep", "--resume", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=os.environ | {"COLUMNS": "400"},
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert f"{damaged}: is not a trial record kvtune wrote" in result.stderr
