"""`make generate` / `make generate-check` (tools/generate.py): the one entry point that writes and checks
every generated file; the committed files are what it gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.observability import alerts, dashboards, readme_sections
from tools import generate

REPO = generate.REPO


def test_the_committed_generated_files_are_current() -> None:
    stale = [str(path.relative_to(REPO)) for path in generate.stale_files()]
    assert not stale, f"stale: {stale}; run `make generate` and commit the result"


def test_it_covers_rules_dashboards_chart_and_readme() -> None:
    expected = {str(path.relative_to(REPO)) for path in generate.expected_files()}
    assert {alerts.RULES_PATH, "README.md", "helm/kvtune/values.schema.json"} <= expected
    assert {"helm/kvtune/templates/_generated.tpl", "helm/kvtune/files/kvtune-alerts.yaml"} <= expected
    for stem in dashboards.all_dashboards():
        assert {f"dashboards/{stem}.json", f"helm/kvtune/files/dashboards/{stem}.json"} <= expected


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A made-up checkout with only the README (its generated sections empty): everything else is written."""
    sections = "\n\n".join(
        "{}\nold\n{}".format(*readme_sections.markers(name))
        for name in (alerts.RUNBOOK_SECTION, dashboards.README_SECTION)
    )
    (tmp_path / "README.md").write_text(f"# kvtune\n\n{sections}\n\nafter\n", encoding="utf-8")
    return tmp_path


def test_write_then_check_passes_and_a_second_write_changes_nothing(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate.main(["--check"], repo=checkout) == 1
    assert generate.main([], repo=checkout) == 0
    assert f"wrote {alerts.RULES_PATH}" in capsys.readouterr().out
    assert (checkout / "README.md").read_text(encoding="utf-8").endswith("\n\nafter\n")
    assert generate.main(["--check"], repo=checkout) == 0
    assert generate.write(checkout) == []


def test_check_names_each_stale_and_obsolete_file_and_write_mends_them(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    generate.write(checkout)
    board = checkout / "dashboards" / f"{next(iter(dashboards.all_dashboards()))}.json"
    board.write_text("{}\n", encoding="utf-8")
    obsolete = checkout / "helm" / "kvtune" / "files" / "dashboards" / "renamed-away.json"
    obsolete.write_text("{}\n", encoding="utf-8")
    capsys.readouterr()
    assert generate.main(["--check"], repo=checkout) == 1
    err = capsys.readouterr().err
    assert f"stale: {board.relative_to(checkout)}\n" in err
    assert f"stale: {obsolete.relative_to(checkout)}\n" in err
    assert "make generate" in err
    assert generate.main([], repo=checkout) == 0
    assert f"removed {obsolete.relative_to(checkout)}" in capsys.readouterr().out
    assert not obsolete.exists()
    assert generate.stale_files(checkout) == []


def test_a_folder_without_the_readme_sections_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "README.md").write_text("# no generated sections\n", encoding="utf-8")
    assert generate.main([], repo=tmp_path) == 2
    assert "kvtune source checkout" in capsys.readouterr().err
    assert not (tmp_path / "dashboards").exists()


def test_it_runs_as_a_script_and_is_not_shipped() -> None:
    script = REPO / "tools" / "generate.py"
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "--check" in result.stdout
    assert not (REPO / "kvtune" / "tools").exists()
    assert "generate-check:" in (REPO / "Makefile").read_text(encoding="utf-8")
