"""`kvtune ask PROFILE`: start the profile's engine, ask it one question, print the answer, stop it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
from rich.console import Console

from kvtune import metrics, openai_client
from kvtune.engine import Engine
from kvtune.model_store import resolve_model
from kvtune.profile import load_profile


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", type=Path, metavar="PROFILE", help="engine profile YAML")
    parser.add_argument("--prompt", default="What is the capital of France?", help="the question")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="answer length limit (default %(default)s)"
    )
    parser.add_argument("--log-dir", type=Path, default=Path("kvtune-logs"), help="engine log folder")
    parser.add_argument(
        "--cache-dir", type=Path, default=None, help="model cache folder (default: user cache)"
    )


def main(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    profile, host_note = load_profile(args.profile).adapted_to_host()
    if host_note:
        console.print(f"note: {host_note}")
    model_path = resolve_model(profile.model, args.cache_dir)
    log_path = args.log_dir / f"{profile.name}.log"
    with (
        console.status(f"engine {profile.name}: starting and asking (log: {log_path})"),
        Engine(profile, log_path, model_path=model_path) as engine,
        httpx.Client(timeout=120.0) as client,
    ):
        messages = [{"role": "user", "content": args.prompt}]
        result = openai_client.stream_chat(
            client, engine.url, profile.api_model_name, messages, max_tokens=args.max_tokens
        )
        capacity = metrics.KvCapacity.from_samples(metrics.scrape(engine.url, client))
    kv = f"{capacity.tokens:,} KV tokens ({capacity.cache_dtype})" if capacity else "KV capacity unknown"
    console.print(f"{profile.name}: {kv}, time to first token {result.ttft or 0:.2f} s")
    sys.stdout.write(f"Q: {args.prompt}\nA: {result.text.strip()}\n")
    return 0
