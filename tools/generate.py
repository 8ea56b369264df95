"""Write, or check, every file kvtune generates from its own sources: the one entry point.

    make generate          (python tools/generate.py)          write what is stale
    make generate-check    (python tools/generate.py --check)  exit 1 naming each stale file

The files: vLLM's flag table (kvtune/vllm_flags.json, read from the installed vLLM's parser), the Prometheus
alert rules (deploy/prometheus/), the Grafana dashboards (dashboards/*.json), the chart's generated files
(kvtune/helm/build.py: values.schema.json, templates, copies of the rules and the dashboards) and the
documentation site's reference pages (docs/reference/*.md, kvtune/reference/: the command line, the profile,
the sweep spec, the chart values, the metrics, the dashboards and the alerts). The runtime modules only render
contents; this script alone knows where the checkout is and writes into it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtune import vllm_flags, vllm_parser
from kvtune.config_errors import ConfigError
from kvtune.files import write_atomic
from kvtune.helm import build
from kvtune.observability import alerts, dashboards
from kvtune.reference import pages

REPO = Path(__file__).resolve().parents[1]
CHART = Path("helm", "kvtune")
REFERENCE = Path("docs", "reference")
# Folders whose every file of the pattern is generated: one the sources no longer give is stale too.
GENERATED_FOLDERS = (
    (Path("dashboards"), "*.json"),
    (CHART / "files" / "dashboards", "*.json"),
    (REFERENCE, "*.md"),
)
TABLE = Path("kvtune", vllm_flags.TABLE_PATH.name)
EXIT_OK, EXIT_STALE, EXIT_BROKEN = 0, 1, 2


def expected_files(repo: Path = REPO) -> dict[Path, str]:
    """Every generated file under REPO and the content its sources give."""
    files = {repo / alerts.RULES_PATH: alerts.render_rules()}
    files[repo / TABLE] = vllm_flags.render(vllm_flags.from_installed_vllm())
    boards = {f"{stem}.json": dashboards.render(data) for stem, data in dashboards.all_dashboards().items()}
    for name, text in boards.items():
        files[repo / "dashboards" / name] = text
    copies = Path("files", "dashboards")
    for path, text in build.generated_files().items():
        relative = path.relative_to(build.CHART_DIR)
        # The chart's dashboard copies are taken from this rendering, not from dashboards/ on disk, so one
        # run writes both and a check does not depend on the order files are written in.
        if relative.parent != copies:
            files[repo / CHART / relative] = text
    for name, text in boards.items():
        files[repo / CHART / copies / name] = text
    for name, text in pages.render_all().items():
        files[repo / REFERENCE / name] = text
    return files


def obsolete_files(expected: dict[Path, str], repo: Path = REPO) -> list[Path]:
    """Files in a generated folder that the sources no longer give (a renamed dashboard's old copy)."""
    return [
        path
        for folder, pattern in GENERATED_FOLDERS
        for path in sorted((repo / folder).glob(pattern))
        if path not in expected
    ]


def stale_files(repo: Path = REPO) -> list[Path]:
    """Generated files missing, differing from what the sources give, or no longer generated at all."""
    expected = expected_files(repo)
    differing = [
        path
        for path, text in expected.items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]
    return differing + obsolete_files(expected, repo)


def write(repo: Path = REPO) -> list[Path]:
    """Bring every generated file up to date; the paths changed (written or removed)."""
    changed = _write_once(repo)
    if repo / TABLE in changed:
        # The chart's flag patterns are read from the table: once more, from the table just written.
        vllm_flags.load.cache_clear()
        vllm_parser.parser.cache_clear()
        changed += [path for path in _write_once(repo) if path not in changed]
    return changed


def _write_once(repo: Path) -> list[Path]:
    expected = expected_files(repo)
    changed = []
    for path, text in expected.items():
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue  # untouched, so its mtime (and make's view of it) stays
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text)
        changed.append(path)
    for path in obsolete_files(expected, repo):
        path.unlink()
        changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None, repo: Path = REPO) -> int:
    parser = argparse.ArgumentParser(
        prog="tools/generate.py",
        description="Write kvtune's generated files (alert rules, dashboards, the chart's generated files, "
        "the documentation's reference pages) from their sources.",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 listing each stale file (what CI runs)"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files(repo)
            for path in stale:
                sys.stderr.write(f"stale: {path.relative_to(repo)}\n")
            if stale:
                sys.stderr.write("run `make generate` and commit the result\n")
                return EXIT_STALE
            return EXIT_OK
        for path in write(repo):
            sys.stdout.write(f"{'wrote' if path.exists() else 'removed'} {path.relative_to(repo)}\n")
    except (
        OSError,
        ValueError,
        ConfigError,
    ) as exc:  # a folder that cannot be written, a source that cannot be read
        sys.stderr.write(f"error: {exc}; run from a kvtune source checkout\n")
        return EXIT_BROKEN
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
