"""Result files and the names that become paths: nothing written outside its folder or over a non-file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtune.files import (
    NAME_LENGTH,
    NotARegularFile,
    child_path,
    derived_name,
    name_problem,
    output_file_problem,
    write_atomic,
)
from kvtune.profile import EngineProfile
from kvtune.sweep.spec import SweepSpec


def test_write_atomic_replaces_a_file_and_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "serve.sh"
    path.write_text("old")
    path.chmod(0o755)
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o755
    assert [p.name for p in tmp_path.iterdir()] == ["serve.sh"]  # no temporary file left


@pytest.mark.parametrize("kind", ["folder", "fifo", "device"])
def test_write_atomic_never_replaces_what_is_not_a_regular_file(tmp_path: Path, kind: str) -> None:
    if kind == "device":
        target = Path("/dev/null")
        assert target.is_char_device()
    else:
        target = tmp_path / kind
        os.mkfifo(target) if kind == "fifo" else target.mkdir()
    before = target.stat()
    with pytest.raises(NotARegularFile, match="not a regular file"):
        # /dev/null's folder is not writable by a test: the refusal comes before any temporary file.
        write_atomic(target, "x")
    after = target.stat()
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: Path("/dev/null"), "not a regular file"),
        (lambda d: d, "not a regular file"),
        (lambda d: d / "missing" / "out.json", "does not exist"),
        (lambda d: d / ("x" * 300), "cannot be used"),
        (lambda d: d / "new.json", None),
    ],
)
def test_output_file_problem_is_checked_before_work(
    tmp_path: Path, make: object, expected: str | None
) -> None:
    assert callable(make)
    problem = output_file_problem(make(tmp_path))
    assert (problem is None) if expected is None else (problem is not None and expected in problem)


@pytest.mark.parametrize("name", ["../../x", "/etc/passwd", "a/b", ".hidden", "..", "", "x\ny", "a b", "é"])
def test_a_name_that_could_become_a_path_is_refused(name: str) -> None:
    problem = name_problem(name)
    assert problem is not None and "cannot be a name" in problem


def test_names_are_bounded_and_derived_names_stay_within_the_bound() -> None:
    longest = "a" * NAME_LENGTH
    assert name_problem(longest) is None
    assert name_problem(longest + "a") is not None
    for suffix in ("tuned", "reference", "t123"):
        derived = derived_name(longest, suffix)
        assert name_problem(derived) is None and derived.endswith(f"-{suffix}")
    assert derived_name("cpu-quick", "tuned") == "cpu-quick-tuned"


def test_child_path_refuses_an_escape_through_a_link(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "out").symlink_to(tmp_path)
    assert child_path(tmp_path / "logs", "engine.log") == tmp_path / "logs" / "engine.log"
    with pytest.raises(ValueError, match="outside"):
        child_path(tmp_path / "logs", "../x.log")
    with pytest.raises(ValueError, match="outside"):
        child_path(tmp_path / "logs", "out/x.log")


def test_profile_and_spec_names_follow_the_same_rule(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be a name"):
        EngineProfile(name="../../x", model="smollm2-135m")
    assert EngineProfile(name="cpu-small", model="smollm2-135m").name == "cpu-small"
    with pytest.raises(ValueError, match="cannot be a name"):
        SweepSpec.model_validate({"name": "/abs"})


def test_an_engine_log_is_never_written_through_a_link_out_of_its_folder(tmp_path: Path) -> None:
    from kvtune.config_errors import ConfigError
    from kvtune.engine import log_file

    logs = tmp_path / "logs"
    logs.mkdir()
    profile = EngineProfile(name="cpu-small", model="smollm2-135m")
    assert log_file(logs, profile) == logs / "cpu-small.log"
    (logs / "cpu-small.log").symlink_to(tmp_path / "elsewhere.log")
    with pytest.raises(ConfigError, match=r"cpu-small.*outside"):
        log_file(logs, profile)
