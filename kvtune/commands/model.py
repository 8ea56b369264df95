"""`kvtune model prepare [NAME]`: build an embedded model's Hugging Face directory in kvtune's cache and
print where it is (model_store does the work)."""

from __future__ import annotations

import argparse
import difflib
import sys

from kvtune.commands.common import ExitCode, add_cache_dir_flag
from kvtune.model_store import DEFAULT_MODEL, EMBEDDED_MODELS, ModelPrepareError, ensure_model, known_models

PREPARE_HELP = "build the embedded model's Hugging Face directory"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    prepare = actions.add_parser("prepare", help=PREPARE_HELP, description=PREPARE_HELP)
    prepare.add_argument(
        "name",
        nargs="?",
        default=DEFAULT_MODEL,
        help=f"embedded model to prepare (default: {DEFAULT_MODEL}; known: {known_models()})",
    )
    add_cache_dir_flag(prepare)


def main(args: argparse.Namespace) -> int:
    return prepare(args)  # the one action so far


def prepare(args: argparse.Namespace) -> int:
    """Prints the prepared directory as the last line of stdout."""
    name: str = args.name
    if name not in EMBEDDED_MODELS:
        near = difflib.get_close_matches(name, EMBEDDED_MODELS, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        sys.stderr.write(f"kvtune: unknown model {name!r}; known models: {known_models()}.{hint}\n")
        return ExitCode.CONFIG
    try:
        path = ensure_model(name, args.cache_dir)
    except ModelPrepareError as error:
        sys.stderr.write(f"kvtune: preparing {name} failed: {error}\n")
        return ExitCode.FAILED
    sys.stdout.write(f"{path}\n")
    return ExitCode.OK
