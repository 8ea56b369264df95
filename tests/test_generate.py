"""`make generate` / `make generate-check` (tools/generate.py): the one entry point that writes and checks
every generated file; the committed files are what it gives."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.observability import alerts, dashboards
from kvtune.reference.pages import PAGES
from tools import generate

REPO = generate.REPO


def test_the_committed_generated_files_are_current() -> None:
    stale = [str(path.relative_to(REPO)) for path in generate.stale_files()]
    assert not stale, f"stale: {stale}; run `make generate` and commit the result"


def test_it_covers_rules_dashboards_chart_and_reference_pages() -> None:
    expected = {str(path.relative_to(REPO)) for path in generate.expected_files()}
    assert {alerts.RULES_PATH, "helm/kvtune/values.schema.json"} <= expected
    assert {f"docs/reference/{name}" for name in PAGES} <= expected
    # The README is written by hand: no generated section in it.
    assert "README.md" not in expected
    assert {"helm/kvtune/templates/_generated.tpl", "helm/kvtune/files/kvtune-alerts.yaml"} <= expected
    for stem in dashboards.all_dashboards():
        assert {f"dashboards/{stem}.json", f"helm/kvtune/files/dashboards/{stem}.json"} <= expected


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A made-up checkout holding only a README: every generated file is written, the README left alone."""
    (tmp_path / "README.md").write_text("# kvtune\n", encoding="utf-8")
    return tmp_path


def test_write_then_check_passes_and_a_second_write_changes_nothing(
    checkout: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate.main(["--check"], repo=checkout) == 1
    assert generate.main([], repo=checkout) == 0
    out = capsys.readouterr().out
    assert f"wrote {alerts.RULES_PATH}" in out
    assert all(f"wrote docs/reference/{name}" in out for name in PAGES)
    assert (checkout / "README.md").read_text(encoding="utf-8") == "# kvtune\n"
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
    page = checkout / generate.REFERENCE / "profile.md"
    page.write_text(page.read_text(encoding="utf-8") + "hand-edited\n", encoding="utf-8")
    old_page = checkout / generate.REFERENCE / "renamed-away.md"
    old_page.write_text("# old\n", encoding="utf-8")
    capsys.readouterr()
    assert generate.main(["--check"], repo=checkout) == 1
    err = capsys.readouterr().err
    for path in (board, obsolete, page, old_page):
        assert f"stale: {path.relative_to(checkout)}\n" in err
    assert "make generate" in err
    assert generate.main([], repo=checkout) == 0
    out = capsys.readouterr().out
    assert f"removed {obsolete.relative_to(checkout)}" in out
    assert f"removed {old_page.relative_to(checkout)}" in out
    assert not obsolete.exists() and not old_page.exists()
    assert "hand-edited" not in page.read_text(encoding="utf-8")
    assert generate.stale_files(checkout) == []


def test_a_checkout_that_cannot_be_written_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_folder = tmp_path / "checkout"
    not_a_folder.write_text("a file, not a folder\n", encoding="utf-8")
    assert generate.main([], repo=not_a_folder) == 2
    err = capsys.readouterr().err
    assert "kvtune source checkout" in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_it_runs_as_a_script_and_is_not_shipped() -> None:
    script = REPO / "tools" / "generate.py"
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "--check" in result.stdout
    assert not (REPO / "kvtune" / "tools").exists()
    assert "generate-check:" in (REPO / "Makefile").read_text(encoding="utf-8")
