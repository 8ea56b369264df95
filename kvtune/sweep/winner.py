"""The winner's files: the winning config as a profile (best.yaml), as the chart's values (values.yaml) and
as a plain vLLM server script (vllm-serve.sh), each saying what the sweep measured of it."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvtune.files import derived_name, write_atomic
from kvtune.helm.values import chart_values, chart_values_header
from kvtune.profile import EngineProfile
from kvtune.sweep.records import RunSummary, describe
from kvtune.sweep.report import slo_text
from kvtune.sweep.spec import SweepSpec


def write_winner_files(
    spec: SweepSpec, run: Path, base: EngineProfile, summary: RunSummary, model_path: str | None
) -> dict[str, Path]:
    """best.yaml (for `kvtune up`), values.yaml (for the chart) and vllm-serve.sh (plain vLLM) of the
    winning config, each headed by what the sweep measured; nothing without a winner."""
    best = summary.best
    if best is None:
        return {}
    profile = base.with_knobs(best.knobs).model_copy(update={"name": derived_name(base.name, "tuned")})
    paths = {"best": run / "best.yaml", "values": run / "values.yaml", "serve": run / "vllm-serve.sh"}
    notes = [
        f"Tuned by `kvtune sweep` ({spec.name}): goodput {best.mean_goodput:.3g} req/s within the SLO",
        f"SLO {slo_text(spec.slo)}; knobs: {describe(best.knobs)}",
        *([summary.envelope] if summary.envelope else []),
        *validation_lines(summary),
        f"Serve it: kvtune up {paths['best']}",
    ]
    header = "".join(f"# {line}\n" for line in notes)
    write_atomic(paths["best"], profile.to_yaml(header))
    values = chart_values(profile, ttft_p99_slo_seconds=spec.slo.ttft_p99_s)
    values_header = "".join(f"# {line}\n" for line in [*chart_values_header(profile), notes[0]])
    write_atomic(paths["values"], values_header + yaml.safe_dump(values, sort_keys=False))
    # The script runs here as written: the config as this host runs it, the embedded model as its path.
    runnable, host_note = profile.adapted_to_host()
    comments = [
        f"The winning config of sweep {spec.name} as a plain vLLM server (what `kvtune up best.yaml` runs).",
        *([f"On this host: {host_note}"] if host_note else []),
    ]
    write_atomic(paths["serve"], runnable.serve_script(model_path, comments))
    paths["serve"].chmod(0o755)
    return paths


def validation_lines(summary: RunSummary) -> list[str]:
    """What best.yaml's header says of the validation step."""
    validation = summary.validation
    if validation is None:
        return []
    winner = validation.configs[0]
    if validation.winner_passed:
        return [f"Validated on held-out load: {winner.verdict}"]
    lines = [f"VALIDATION FAILED on held-out load: {winner.verdict}"]
    if validation.holding:
        held = next(c for c in validation.configs if c.label == validation.holding)
        lines.append(f"Next-best config that held: {held.label} ({describe(held.knobs)}); see the report")
    else:
        lines.append("No other validated config held either; see the report before deploying this")
    return lines
