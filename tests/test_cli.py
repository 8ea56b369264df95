"""The `kvtune` command line: every subcommand reachable, and only the one that runs is imported."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvtune.cli import SUBCOMMANDS, build_parser


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_subcommand_gets_its_flags_and_handler_when_named(name: str) -> None:
    argv = [name, "--help"]
    parser = build_parser(argv)
    full = build_parser()
    chosen = {action.dest for action in _sub(parser, name)._actions}
    assert chosen == {action.dest for action in _sub(full, name)._actions}
    assert len(chosen) > 1


def _sub(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = subparsers.choices[name]
    return sub


def test_a_light_subcommand_does_not_import_the_heavy_ones() -> None:
    # `kvtune render --help` needs neither scipy (the sweep's statistics) nor Locust nor grafana-client.
    code = (
        "import sys; from kvtune.cli import main\n"
        "try:\n    main(['render', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('scipy', 'locust', 'grafana_client', 'fastapi') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
