"""`kvtune alerts`: print kvtune's Prometheus alert rules, the TTFT alert at a chosen SLO (the committed
deploy/prometheus/kvtune-alerts.yaml holds the default)."""

from __future__ import annotations

import argparse
import sys

from kvtune.commands.common import ExitCode, add_ttft_slo_flag
from kvtune.observability import alerts
from kvtune.slo import DEFAULT_TTFT_P99_SLO_S


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_ttft_slo_flag(
        parser,
        default=DEFAULT_TTFT_P99_SLO_S,
        help_text="P99 time-to-first-token SLO of KvtuneTtftP99AboveSlo, seconds (default %(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    sys.stdout.write(alerts.render_rules(args.ttft_slo))
    return ExitCode.OK
