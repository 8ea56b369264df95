"""`kvtune render PROFILE`: print the vLLM command line and `vllm serve` YAML a profile stands for."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvtune.model_store import EMBEDDED_MODELS, model_dir
from kvtune.profile import load_profile


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", type=Path, metavar="PROFILE", help="engine profile YAML")
    parser.add_argument(
        "--format",
        choices=("all", "argv", "yaml", "env"),
        default="all",
        help="what to print (default %(default)s)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache folder (default: user cache)"
    )


def main(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    # An embedded model is shown where it will live; rendering never downloads it.
    model_path = str(model_dir(profile.model, args.cache_dir)) if profile.model in EMBEDDED_MODELS else None
    env = profile.engine_env()
    env_prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = shlex.join(profile.argv(model_path, python="python"))
    parts = {
        "argv": f"{env_prefix} {command}".strip(),
        "yaml": profile.serve_yaml(model_path),
        "env": "\n".join(f"{k}={v}" for k, v in env.items()),
    }
    if args.format != "all":
        sys.stdout.write(parts[args.format].rstrip("\n") + "\n")
        return 0
    capacity = profile.kv_capacity_tokens()
    _adapted, host_note = profile.adapted_to_host()
    sys.stdout.write(
        f"# {profile.name}: command line\n{parts['argv']}\n\n"
        f"# {profile.name}: vllm serve config\n{parts['yaml']}\n"
        f"# KV capacity by arithmetic: {f'{capacity:,} tokens' if capacity else 'set by vLLM at start-up'}\n"
        + (f"# On this host: {host_note}\n" if host_note else "")
    )
    return 0
