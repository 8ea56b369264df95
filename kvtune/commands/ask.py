"""`kvtune ask PROFILE`: start the profile's engine, ask it one question, print the answer, stop it."""

from __future__ import annotations

import argparse
import sys

import httpx
from rich.console import Console
from rich.markup import escape

from kvtune import metrics, openai_client
from kvtune.commands.common import (
    ExitCode,
    add_cache_dir_flag,
    add_log_dir_flag,
    add_profile_argument,
    positive_count,
)
from kvtune.engine import Engine, EngineError, PortInUseError, check_port_free, log_file
from kvtune.files import ensure_writable_folder
from kvtune.model_store import ModelPrepareError, resolve_model
from kvtune.profile import load_profile


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_profile_argument(parser)
    parser.add_argument("--prompt", default="What is the capital of France?", help="the question")
    parser.add_argument(
        "--max-tokens", type=positive_count, default=32, help="answer length limit (default %(default)s)"
    )
    add_log_dir_flag(parser)
    add_cache_dir_flag(parser)


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    if args.max_tokens < 1:
        console.print("[red]error:[/red] --max-tokens must be at least 1")
        return ExitCode.CONFIG
    profile, host_note = load_profile(args.profile).adapted_to_host()
    if host_note:
        console.print(f"note: {escape(host_note)}")
    # Bad input is refused before the model is prepared or an engine starts.
    try:
        check_port_free(profile.host, profile.port, f"engine {profile.name!r} (profile field 'port')")
    except PortInUseError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return ExitCode.CONFIG
    profile.check_credentials()
    ensure_writable_folder(args.log_dir, "--log-dir")
    log_path = log_file(args.log_dir, profile)
    try:
        model_path = resolve_model(profile.model, args.cache_dir)
        with (
            console.status(f"engine {profile.name}: starting and asking (log: {log_path})"),
            Engine(profile, log_path, model_path=model_path) as engine,
            openai_client.client_for(profile.api_key(), timeout=120.0) as client,
        ):
            messages = [{"role": "user", "content": args.prompt}]
            result = openai_client.stream_chat(
                client, engine.url, profile.api_model_name, messages, max_tokens=args.max_tokens
            )
            capacity = metrics.KvCapacity.from_samples(metrics.scrape(engine.url, client))
    except (EngineError, ModelPrepareError, httpx.HTTPError) as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return ExitCode.FAILED
    kv = f"{capacity.tokens:,} KV tokens ({capacity.cache_dtype})" if capacity else "KV capacity unknown"
    console.print(f"{profile.name}: {kv}, time to first token {result.ttft or 0:.2f} s")
    sys.stdout.write(f"Q: {args.prompt}\nA: {result.text.strip()}\n")
    return ExitCode.OK
