"""`kvtune render PROFILE`: print the vLLM command line and `vllm serve` YAML a profile stands for, or
(`--as helm-values`) the kvtune chart's values that deploy it."""

from __future__ import annotations

import argparse
import shlex
import sys

import yaml

from kvtune.commands.common import add_cache_dir_flag, add_profile_argument, add_ttft_slo_flag
from kvtune.helm.values import chart_values, chart_values_header
from kvtune.model_store import EMBEDDED_MODELS, model_dir
from kvtune.profile import load_profile


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_profile_argument(parser)
    parser.add_argument(
        "--format",
        choices=("all", "argv", "script", "yaml", "env"),
        default="all",
        help="what to print: the shell command, a runnable sh script, the serve YAML, the environment "
        "(default %(default)s)",
    )
    add_cache_dir_flag(parser)
    parser.add_argument(
        "--as",
        dest="render_as",
        choices=("vllm", "helm-values"),
        default="vllm",
        help="vllm: the engine's command and config (default); helm-values: values for the kvtune chart "
        "(helm install NAME helm/kvtune -f FILE)",
    )
    add_ttft_slo_flag(
        parser, default=None, help_text="with --as helm-values: the P99 TTFT SLO of the chart's alert rule"
    )


def main(args: argparse.Namespace) -> int:
    if args.render_as == "helm-values":
        return _helm_values(args)
    # What this host really runs (an fp8 KV cache falls back where vLLM cannot keep it), so the printed
    # command and script start here as printed.
    profile, host_note = load_profile(args.profile).adapted_to_host()
    # An embedded model is shown where it will live; rendering never downloads it.
    model_path = str(model_dir(profile.model, args.cache_dir)) if profile.model in EMBEDDED_MODELS else None
    # Credentials are named, never shown: secret_env and the API key come from the environment at start.
    needs = [*profile.secret_env, *([profile.api_key_env] if profile.api_key_env else [])]
    parts = {
        "argv": shlex.join(profile.launch_command(model_path)),
        "script": profile.serve_script(model_path),
        "yaml": profile.serve_yaml(model_path),
        "env": "\n".join(f"{k}={shlex.quote(v)}" for k, v in profile.engine_env().items()),
    }
    if args.format != "all":
        sys.stdout.write(parts[args.format].rstrip("\n") + "\n")
        return 0
    capacity = profile.kv_capacity_tokens()
    sys.stdout.write(
        f"# {profile.name}: command line\n{parts['argv']}\n\n"
        f"# {profile.name}: vllm serve config\n{parts['yaml']}\n"
        f"# KV capacity by arithmetic: {f'{capacity:,} tokens' if capacity else 'set by vLLM at start-up'}\n"
        + (f"# Needs in the environment: {', '.join(needs)}\n" if needs else "")
        + (f"# On this host: {host_note}\n" if host_note else "")
    )
    return 0


def _helm_values(args: argparse.Namespace) -> int:
    # The profile as written, not as this host runs it: the chart runs on the cluster's nodes.
    profile = load_profile(args.profile)
    values = chart_values(profile, ttft_p99_slo_seconds=args.ttft_slo)
    header = "".join(f"# {line}\n" for line in chart_values_header(profile))
    sys.stdout.write(header + yaml.safe_dump(values, sort_keys=False))
    return 0
