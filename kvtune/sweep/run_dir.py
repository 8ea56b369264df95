"""A sweep's run folder: created once, never overwritten, readable by `--resume` and the report.

Layout:
  spec.yaml, base-profile.yaml   the spec as run (its base profile copied beside it, so the run stands alone)
  trials/NNN-<config>-rK/        profile.yaml, engine.log, Locust samples, then result.json or failure.json
  pruned.json                    configs ruled out by KV arithmetic, with the arithmetic
  summary.json, report.md, report.html, plots/, best.yaml, values.yaml, vllm-serve.sh
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvtune.config_errors import ConfigError
from kvtune.documents import dump_yaml, read_text, read_yaml
from kvtune.files import ensure_writable_folder, write_atomic
from kvtune.sweep.records import TrialRecord, read_record
from kvtune.sweep.spec import SweepSpec, load_spec

SPEC_FILE = "spec.yaml"
BASE_PROFILE_FILE = "base-profile.yaml"
RESULT_FILE = "result.json"
FAILURE_FILE = "failure.json"
PRUNED_FILE = "pruned.json"
SUMMARY_FILE = "summary.json"


def check_runs_dir(root: Path) -> None:
    """Refuse, before anything starts, a --runs-dir that is not a folder or cannot be written."""
    ensure_writable_folder(root, "--runs-dir")


def create(root: Path, spec: SweepSpec, spec_path: Path) -> Path:
    """A new run folder under `root`, named after the spec and the time; an existing one is never reused."""
    folder = _new_folder(root, spec.name)
    # Read as they were loaded (regular files, bounded, YAML 1.2), so the copies are what was validated.
    write_atomic(folder / BASE_PROFILE_FILE, read_text(spec.base_profile))
    write_atomic(folder / SPEC_FILE, run_spec_yaml(spec, spec_path))
    (folder / "trials").mkdir()
    _point_latest(root / f"{spec.name}-latest", folder)
    return folder


def create_joined(root: Path, name: str, spec_yaml: str, base_profile: str) -> Path:
    """A new run folder for a worker joining a shared study: the study's spec and base profile written into
    it, as `create` writes a spec file's."""
    folder = _new_folder(root, name)
    write_atomic(folder / BASE_PROFILE_FILE, base_profile)
    write_atomic(folder / SPEC_FILE, spec_yaml)
    (folder / "trials").mkdir()
    _point_latest(root / f"{name}-latest", folder)
    return folder


def run_spec_yaml(spec: SweepSpec, spec_path: Path) -> str:
    """The spec as a run folder keeps it: its base profile is the copy beside it."""
    data = read_yaml(spec_path)
    data["base_profile"] = BASE_PROFILE_FILE
    return f"# Run of {spec_path}; base_profile copied from {spec.base_profile}\n" + dump_yaml(data)


def _new_folder(root: Path, name: str) -> Path:
    """A folder under ROOT named after NAME and the time, made now; an existing one is never reused."""
    check_runs_dir(root)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        folder = root / f"{name}-{stamp}{f'-{attempt}' if attempt else ''}"
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise ConfigError(f"cannot create a new run folder under {root}: too many runs this second")


def _point_latest(link: Path, folder: Path) -> None:
    """`<name>-latest` always leads to the newest run (replaced atomically; the runs themselves stay)."""
    tmp = link.with_name(f".{link.name}.{folder.name}")
    tmp.symlink_to(folder.name)
    tmp.replace(link)


def open_existing(folder: Path) -> SweepSpec:
    """The spec a run folder was started with; ConfigError when `folder` is not a run folder."""
    if not (folder / SPEC_FILE).is_file():
        raise ConfigError(
            f"{folder} is not a sweep run folder (no {SPEC_FILE}); pass the folder a sweep printed"
        )
    return load_spec(folder / SPEC_FILE)


def trial_folder(run: Path, number: int, config_id: str, repeat: int) -> Path:
    return run / "trials" / f"{number:03d}-{config_id}-r{repeat}"


def next_trial_number(run: Path) -> int:
    """After every trial folder there is, finished or interrupted, so no folder is ever reused."""
    numbers = [int(f.name.split("-", 1)[0]) for f in (run / "trials").iterdir() if f.name[:3].isdigit()]
    return max(numbers, default=0) + 1


def save_trial(folder: Path, record: TrialRecord) -> Path:
    """result.json for a measured trial, failure.json for one that could not be measured."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (RESULT_FILE if record.status == "done" else FAILURE_FILE)
    write_atomic(path, record.model_dump_json(indent=2))
    return path


def finished_trials(run: Path) -> list[TrialRecord]:
    """Every trial with a result or failure file, in run order; folders without one were interrupted."""
    records = []
    for folder in sorted((run / "trials").iterdir()):
        for name in (RESULT_FILE, FAILURE_FILE):
            if (folder / name).is_file():
                records.append(_read_record(folder / name))
    return records


def _read_record(path: Path) -> TrialRecord:
    """A trial's record as kvtune wrote it; ConfigError naming the file when it was damaged since."""
    return read_record(TrialRecord, path, "a trial record")


def interrupted_folders(run: Path) -> list[Path]:
    return [f for f in sorted((run / "trials").iterdir()) if f.is_dir() and not _finished(f)]


def _finished(folder: Path) -> bool:
    return (folder / RESULT_FILE).is_file() or (folder / FAILURE_FILE).is_file()


def save_pruned(run: Path, records: list[TrialRecord]) -> None:
    write_atomic(run / PRUNED_FILE, json.dumps([r.model_dump(mode="json") for r in records], indent=2))
