"""The sweep report: `report.md` and a self-contained `report.html` with SVG plots, written into a run folder.

It answers, in order: which config won and by how much (or that none met the SLO and which came closest),
how every config fared, and why each missed step missed, in the engine's own figures. The figures, the
tables' columns and the prose are formatted once here, in one context; the two templates only lay them
out, so the Markdown and the HTML report cannot say different things.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from markdown_it import MarkdownIt
from markupsafe import Markup

from kvtune.files import write_atomic
from kvtune.sweep import capacity, ranking, validation_report
from kvtune.sweep.plots import PLOTS, inline_svg, kv_points, write_plots
from kvtune.sweep.records import (
    ConfigSummary,
    QualityRecord,
    RunSummary,
    StepRecord,
    TrialRecord,
    describe,
)
from kvtune.sweep.shown_step import kv_tokens, representative, telling_step, worst_preemptions
from kvtune.sweep.spec import Slo, SweepSpec, quantile_label
from kvtune.sweep.summary import (
    closest_miss,
    explain_miss,
    group_trials,
    ranked,
    status_rank,
    ttft_breakdown,
)
from kvtune.sweep.trace_curve import CURVE_PLOT, write_curve_plot

DASH = "—"


# --- Figures as text ---------------------------------------------------------------------------------


def _num(value: float | None, fmt: str = ".2f") -> str:
    return DASH if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return DASH if value is None else f"{value:.0%}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _drift_text(summary: RunSummary) -> str | None:
    check = summary.drift
    if check is None:
        return None
    remeasured = (
        f" Measured again for contradicting a neighbour: {'; '.join(check.remeasured)}."
        if check.remeasured
        else ""
    )
    return check.sentence() + remeasured


def slo_text(slo: Slo) -> str:
    targets = [f"{quantile_label(metric, q)} ≤ {value:.3g} s" for _name, metric, q, value in slo.targets()]
    return (
        ", ".join([*targets, f"errors ≤ {slo.max_error_rate:.1%}"]) + f" (at {slo.confidence:.0%} confidence)"
    )


def goodput_text(config: ConfigSummary) -> str:
    text = ranking.goodput_words(config, ".2f")
    if config.ci95 is not None:
        text += f" (95% CI {config.ci95[0]:.2f}-{config.ci95[1]:.2f}, {len(config.goodputs)} repeats)"
    return text


def quality_text(quality: QualityRecord | None) -> str:
    if quality is None:
        return DASH
    verdict = "passed" if quality.passed else "FAILED"
    return (
        f"{verdict}: token agreement {quality.token_agreement:.3f} (min {quality.min_token_agreement:.3f}), "
        f"log-prob divergence {quality.logprob_divergence:.3f} (max {quality.max_logprob_divergence:.3f}), "
        f"KV {quality.kv_cache_dtype}"
    )


# --- What each config row shows ------------------------------------------------------------------------


def preemptions_text(trial: TrialRecord, step: StepRecord | None) -> str:
    """Preemptions at the row's step, and the worst step's when higher: at goodput they are usually 0."""
    if step is None:
        return DASH
    text = f"{step.result.engine.preemptions:,.0f}"
    worst, worst_step = worst_preemptions(trial)
    if worst_step is not None and worst > step.result.engine.preemptions:
        text += f" ({worst:,.0f} at {worst_step.rate:.2f} req/s)"
    return text


@dataclass(frozen=True)
class ConfigRow:
    config_id: str
    knobs: str
    status: str
    goodput: str
    kv_tokens: str
    hit_rate: str
    preemptions: str
    peak_kv: str
    ttft_at: str
    ttft_queue: str
    ttft_prefill: str
    ttft_other: str
    quality: str
    winner: bool
    worker: str


def config_row(config: ConfigSummary, trials: list[TrialRecord], winner: str | None) -> ConfigRow:
    trial = representative(trials)
    step = telling_step(trial)
    engine = step.result.engine if step else None
    parts = ttft_breakdown(step.result) if step else {}
    tokens = kv_tokens(trial, step)
    measured = config.status == "done"
    return ConfigRow(
        config_id=config.config_id,
        knobs=describe(config.knobs),
        status=config.status + (" (winner)" if config.config_id == winner else ""),
        goodput=goodput_text(config) if measured else DASH,
        kv_tokens=DASH if tokens is None else f"{tokens:,}",
        hit_rate=_pct(engine.hit_rate) if engine else DASH,
        preemptions=preemptions_text(trial, step),
        peak_kv=_pct(engine.peak_kv_usage) if engine else DASH,
        ttft_at=f"{step.rate:.2f} req/s" if step else DASH,
        ttft_queue=_num(parts.get("queue")),
        ttft_prefill=_num(parts.get("prefill")),
        ttft_other=_num(parts.get("other")),
        quality=quality_text(trial.quality),
        winner=config.config_id == winner,
        worker=", ".join(
            dict.fromkeys(f"{t.worker} ({t.devices})" if t.devices else t.worker for t in trials if t.worker)
        )
        or DASH,
    )


@dataclass(frozen=True)
class Column:
    """One table column of both reports: its heading, the row field it shows, and how it is set."""

    title: str
    field: str
    kind: str = "text"  # text, num (right-aligned figures) or wide (sentences)


# The configs table after its first column (the config id, marked when it won).
CONFIG_COLUMNS = (
    Column("Knobs", "knobs"),
    Column("Status", "status"),
    Column("Goodput", "goodput", "num"),
    Column("KV tokens", "kv_tokens", "num"),
    Column("Hit rate", "hit_rate", "num"),
    Column("Preemptions", "preemptions", "num"),
    Column("Peak KV", "peak_kv", "num"),
    Column("TTFT at", "ttft_at", "num"),
    Column("Queue s", "ttft_queue", "num"),
    Column("Prefill s", "ttft_prefill", "num"),
    Column("Other s", "ttft_other", "num"),
    Column("Quality gate", "quality", "wide"),
)
# Shown when workers of a shared study measured the configs: which one measured each (HOST:PID).
WORKER_COLUMN = Column("Worker", "worker")
CONFIGS_NOTE = (
    "Hit rate, preemptions, peak KV and the TTFT breakdown (engine means: queue, prefill, the rest) come "
    "from the step at goodput, or the first missed step when none met the SLO; preemptions add the worst "
    "step's count when higher."
)

# The load-steps table after its first column (the config id): every step, the sample its verdict rests
# on, the bounds that decided it (or left it open), and for a step that did not pass, why.
MISS_COLUMNS = (
    Column("Repeat", "repeat", "num"),
    Column("Rate (req/s)", "rate", "num"),
    Column("Requests", "requests", "num"),
    Column("Verdict", "decision"),
    Column("Bounds", "misses", "wide"),
    Column("Why (engine figures)", "explanation", "wide"),
)
NO_MISSES = "No load step was measured."
ALL_MEASURED = "Every config was measured."


@dataclass(frozen=True)
class MissRow:
    config_id: str
    repeat: int
    rate: str
    requests: str
    decision: str
    misses: str
    explanation: str


def _bounds_text(step: StepRecord) -> str:
    if step.verdicts:
        return "; ".join(v.sentence("" if v.name == "error rate" else " s") for v in step.verdicts)
    return "; ".join(step.misses)  # a record from before verdicts carried bounds


def _again(step: StepRecord) -> str:
    """A rate looked at again (the goodput's confirmation) says which sample this row is."""
    return f" (sample {step.sample})" if step.sample > 1 else ""


def miss_rows(trials: list[TrialRecord]) -> list[MissRow]:
    """Every measured load step, in trial order."""
    rows = []
    for t in sorted(trials, key=lambda t: t.trial):
        for s in t.steps:
            windows = f" ({s.result.windows} windows)" if s.result.windows > 1 else ""
            rows.append(
                MissRow(
                    t.config_id, t.repeat, f"{s.rate:.2f}{_again(s)}", f"{s.requests_due:,}{windows}",
                    s.decided, _bounds_text(s),
                    DASH if s.passed else explain_miss(s, t.knobs),
                )
            )  # fmt: skip
    return rows


@dataclass(frozen=True)
class SkippedRow:
    config_id: str
    knobs: str
    status: str
    repeat: int
    reason: str


def skipped_rows(trials: list[TrialRecord]) -> list[SkippedRow]:
    """Every trial that measured nothing, its reason verbatim; the same reason once per config."""
    rows: dict[tuple[str, str, str], SkippedRow] = {}
    for t in trials:
        if t.status != "done":
            reason = t.reason or "no reason recorded"
            row = SkippedRow(t.config_id, describe(t.knobs), t.status, t.repeat, reason)
            rows.setdefault((t.config_id, t.status, reason), row)
    return list(rows.values())


@dataclass(frozen=True)
class Verdict:
    """The headline: a winner, or that none met the SLO and which came closest."""

    winner_id: str | None = None
    winner_knobs: str = ""
    winner_goodput: str = ""
    no_winner: str = ""
    closest_id: str | None = None
    closest_knobs: str = ""
    closest_rate: str = ""
    closest_misses: str = ""
    closest_why: str = ""


def verdict(spec: SweepSpec, summary: RunSummary, trials: list[TrialRecord]) -> Verdict:
    if summary.best is not None:
        best = summary.best
        return Verdict(best.config_id, describe(best.knobs), goodput_text(best))
    met_but_failed = [c.config_id for c in summary.configs if c.status == "done" and c.mean_goodput > 0]
    if met_but_failed:
        no_winner = (
            f"No config is eligible: {', '.join(met_but_failed)} met the SLO but failed the quality gate, "
            "and no other config met the SLO at any rate tried."
        )
    else:
        no_winner = "No config met the SLO at any rate tried."
    closest = closest_miss(spec.slo, trials)
    if closest is None:
        return Verdict(no_winner=no_winner + " No load step was measured.")
    trial, step = closest
    return Verdict(
        no_winner=no_winner,
        closest_id=trial.config_id,
        closest_knobs=describe(trial.knobs),
        closest_rate=f"{step.rate:.2f} req/s",
        closest_misses="; ".join(step.misses),
        closest_why=explain_miss(step, trial.knobs),
    )


def trial_note(spec: SweepSpec) -> str | None:
    """What trial engines ran with that best.yaml does not carry."""
    settings = spec.trial.model_dump(exclude_defaults=True)
    if not settings:
        return None
    listed = ", ".join(f"{k}: {v}" for k, v in settings.items())
    return (
        f"Trial engines ran with trial-only settings ({listed}) to make trials cheap; best.yaml keeps the "
        "base profile's values for them."
    )


def validation_context(summary: RunSummary) -> dict[str, Any] | None:
    validation = summary.validation
    if validation is None:
        return None
    return {
        "headline": validation_report.headline(validation),
        "passed": validation.winner_passed,
        "loads": validation.loads,
        "settings_note": validation.settings_note,
        "rows": validation_report.rows(validation),
        "compared": validation_report.compared_label(validation),
        "ratios": [validation_report.ratio_text(r) for r in validation.ratios],
    }


def finished_text(summary: RunSummary) -> str:
    if summary.finished:
        return "Finished: every planned trial ran."
    return f"Stopped early: {summary.stopped_because or 'no reason recorded'}."


def ordered(configs: list[ConfigSummary]) -> list[ConfigSummary]:
    """Contenders best first, then the rest: measured before failed before never started."""
    contenders = {c.config_id: i for i, c in enumerate(ranked(configs))}
    return sorted(
        configs,
        key=lambda c: (contenders.get(c.config_id, len(contenders)), status_rank(c.status), -c.mean_goodput),
    )


# --- Templates: kvtune/sweep/templates/, laid out from one context ---------------------------------------

TEMPLATES_DIR = "templates"
MARKDOWN_TEMPLATE = "report.md.j2"
HTML_TEMPLATE = "report.html.j2"


def _md_cell(value: object) -> str:
    """A Markdown table cell: a pipe would end the cell and a newline the row."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _environment(*, html: bool) -> jinja2.Environment:
    # Markdown is not HTML: escaping would show `&lt;` to readers of the raw file; cells use the md filter.
    env = jinja2.Environment(
        # The templates ship inside the package (pyproject's package-data), read where kvtune is installed.
        loader=jinja2.PackageLoader("kvtune.sweep", TEMPLATES_DIR),
        autoescape=html,  # noqa: S701
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["md"] = _md_cell
    return env


def markdown_html(text: str) -> Markup:
    """Markdown lines the report shares with the console (a list, a table) as HTML; raw HTML in the text is
    escaped, not passed through."""
    return Markup(MarkdownIt("commonmark", {"html": False}).enable("table").render(text))  # noqa: S704


def _render(template: str, context: dict[str, Any], *, html: bool) -> str:
    return _environment(html=html).get_template(template).render(context)


def report_context(spec: SweepSpec, summary: RunSummary, trials: list[TrialRecord]) -> dict[str, Any]:
    """Everything both templates show, already formatted."""
    groups = group_trials(trials)
    winner = summary.best.config_id if summary.best else None
    return {
        "name": summary.name,
        "strategy": summary.strategy,
        "base_profile": summary.base_profile,
        "slo": slo_text(spec.slo),
        "trials_run": summary.trials_run,
        "repeats": spec.repeats,
        "elapsed": _duration(summary.elapsed_s),
        "finished": finished_text(summary),
        "host_note": summary.host_note,
        "v": verdict(spec, summary, trials),
        "within_noise": summary.within_noise,
        "comparisons": summary.comparisons,
        "drift": _drift_text(summary),
        "envelope": summary.envelope,
        "trial_note": trial_note(spec),
        "val": validation_context(summary),
        "capacity": "\n".join(capacity.replica_lines(summary, trials)) if summary.validation else None,
        "plots": PLOTS,
        "config_columns": CONFIG_COLUMNS + ((WORKER_COLUMN,) if any(t.worker for t in trials) else ()),
        "rows": [config_row(c, groups[c.config_id], winner) for c in ordered(summary.configs)],
        "configs_note": CONFIGS_NOTE,
        "miss_columns": MISS_COLUMNS,
        "misses": miss_rows(trials),
        "no_misses": NO_MISSES,
        "skipped": skipped_rows(trials),
        "all_measured": ALL_MEASURED,
    }


def write_report(
    run_dir: Path, spec: SweepSpec, summary: RunSummary, trials: list[TrialRecord]
) -> tuple[Path, Path]:
    """Write `report.md` and `report.html` (plots inlined) into `run_dir`, plots under `run_dir/plots/`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    winner = summary.best.config_id if summary.best else None
    plots = write_plots(run_dir / "plots", spec, ordered(summary.configs), trials, winner)
    context = report_context(spec, summary, trials)
    measured = kv_points(ordered(summary.configs), group_trials(trials))
    curve = write_curve_plot(
        run_dir / "plots", spec, [(point.tokens, point.hit_rate, point.config_id) for point in measured]
    )
    if curve is not None:
        plots["curve"] = curve
        context["plots"] = (*context["plots"], CURVE_PLOT)
    md_path, html_path = run_dir / "report.md", run_dir / "report.html"
    write_atomic(md_path, _render(MARKDOWN_TEMPLATE, context, html=False))
    svgs = {name: inline_svg(path) for name, path in plots.items()}
    capacity_html = markdown_html(context["capacity"]) if context["capacity"] else None
    write_atomic(
        html_path, _render(HTML_TEMPLATE, context | {"svgs": svgs, "capacity_html": capacity_html}, html=True)
    )
    return md_path, html_path
