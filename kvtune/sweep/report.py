"""The sweep report: `report.md` and a self-contained `report.html` with SVG plots, written into a run folder.

It answers, in order: which config won and by how much (or that none met the SLO and which came closest),
how every config fared, and why each missed step missed, in the engine's own figures. The figures, the
tables' columns and the prose are formatted once here, in one context; the two templates only lay them
out, so the Markdown and the HTML report cannot say different things.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from markupsafe import Markup

from kvtune.files import write_atomic
from kvtune.sweep import validation_report
from kvtune.sweep.records import (
    ConfigSummary,
    QualityRecord,
    RunSummary,
    StepRecord,
    TrialRecord,
    describe,
)
from kvtune.sweep.spec import Slo, SweepSpec, quantile_label
from kvtune.sweep.summary import (
    closest_miss,
    explain_miss,
    group_trials,
    ranked,
    status_rank,
    ttft_breakdown,
)

if TYPE_CHECKING:  # matplotlib itself is imported when plotting, after the backend is chosen
    from matplotlib.figure import Figure

# Knobs that set the KV budget, in the order the KV plot falls back on when the pool size is unknown.
BUDGET_KNOBS = ("num_gpu_blocks_override", "kv_cache_memory_bytes", "gpu_memory_utilization")

DASH = "—"

# name, title (the image's alt text), and how to read it.
PLOTS = (
    ("goodput", "Goodput per config",
     "Bars: mean goodput over repeats, whiskers its 95% interval; hatched: met the SLO but failed the "
     "quality gate; red x: never measured (pruned, infeasible or failed)."),
    ("pareto", "Throughput vs P99 TTFT, every measured step",
     "Every load step of every trial; the red staircase is the most output tokens/s seen at or below each "
     "P99 TTFT (the Pareto front)."),
    ("kv", "Prefix-cache hit rate and preemptions vs KV budget",
     "Each measured config: hit rate at its step at goodput (or first missed step), preemptions at its "
     "worst step."),
)  # fmt: skip


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
    text = f"{config.mean_goodput:.2f} req/s"
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


def representative(trials: list[TrialRecord]) -> TrialRecord:
    """The repeat a config's row describes: an eligible one if any, else a measured one, else the first."""
    eligible = [t for t in trials if t.eligible]
    measured = [t for t in trials if t.status == "done"]
    return (eligible or measured or trials)[0]


def telling_step(trial: TrialRecord) -> StepRecord | None:
    """The step at goodput, or the first missed step when none passed."""
    return trial.best_step or next((s for s in trial.steps if not s.passed), None)


def kv_tokens(trial: TrialRecord, step: StepRecord | None) -> int | None:
    capacity = trial.kv_capacity or (step.result.engine.kv_capacity if step else None) or {}
    tokens = capacity.get("tokens")
    return int(tokens) if tokens else None


def worst_preemptions(trial: TrialRecord) -> tuple[float, StepRecord | None]:
    """The most preemptions any one step of `trial` saw, and that step."""
    step = max(trial.steps, key=lambda s: s.result.engine.preemptions, default=None)
    return (step.result.engine.preemptions, step) if step else (0.0, None)


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


def miss_rows(trials: list[TrialRecord]) -> list[MissRow]:
    """Every measured load step, in trial order."""
    rows = []
    for t in sorted(trials, key=lambda t: t.trial):
        for s in t.steps:
            windows = f" ({s.result.windows} windows)" if s.result.windows > 1 else ""
            rows.append(
                MissRow(
                    t.config_id, t.repeat, f"{s.rate:.2f}", f"{s.requests_due:,}{windows}",
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


# --- Plots ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KvPoint:
    config_id: str
    tokens: int | None
    budget: str | None
    hit_rate: float | None
    preemptions: float


def kv_points(configs: list[ConfigSummary], groups: dict[str, list[TrialRecord]]) -> list[KvPoint]:
    points = []
    for config in configs:
        trial = representative(groups[config.config_id])
        step = telling_step(trial)
        if config.status != "done" or step is None:
            continue
        knob = next((k for k in BUDGET_KNOBS if k in trial.knobs), None)
        budget = f"{knob}={trial.knobs[knob]}" if knob else None
        engine = step.result.engine
        tokens = kv_tokens(trial, step)
        # Preemptions happen past the edge, not at goodput: plot the worst step's.
        preemptions, _ = worst_preemptions(trial)
        points.append(KvPoint(config.config_id, tokens, budget, engine.hit_rate, preemptions))
    return points


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other beats on both lower P99 TTFT (x) and higher throughput (y), by rising x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _varying_knobs(configs: list[ConfigSummary]) -> list[str]:
    """Knobs whose value differs between configs: the ones worth printing under each bar."""
    keys = list(dict.fromkeys(k for c in configs for k in c.knobs))
    return [k for k in keys if len({str(c.knobs.get(k)) for c in configs}) > 1]


def _goodput_size(count: int) -> tuple[float, float]:
    """Room for each bar's multi-line label, within what a report page can show."""
    return min(18.0, max(6.0, 1.6 * count + 1.5)), 5.0


def _plot_goodput(fig: Figure, configs: list[ConfigSummary], winner: str | None) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax = fig.add_subplot()
    varying = _varying_knobs(configs)
    labels = [
        "\n".join([c.config_id, *(f"{k}={c.knobs[k]}" for k in varying if k in c.knobs)]) for c in configs
    ]
    positions = list(range(len(configs)))
    heights = [c.mean_goodput if c.status == "done" else 0.0 for c in configs]
    colors = ["tab:green" if c.config_id == winner else "tab:blue" for c in configs]
    lower = [c.mean_goodput - c.ci95[0] if c.ci95 else 0.0 for c in configs]
    upper = [c.ci95[1] - c.mean_goodput if c.ci95 else 0.0 for c in configs]
    has_ci = any(c.ci95 for c in configs)
    bars = ax.bar(
        positions,
        heights,
        color=colors,
        edgecolor="black",
        linewidth=0.6,
        yerr=[lower, upper] if has_ci else None,
        capsize=4,
    )
    for position, bar, config in zip(positions, bars, configs, strict=True):
        if config.status != "done":
            ax.plot(position, 0, marker="x", color="tab:red", markersize=9, clip_on=False)
            ax.annotate(
                config.status,
                (position, 0),
                xytext=(0, 8),
                textcoords="offset points",
                ha="center",
                rotation=90,
                fontsize=8,
                color="tab:red",
            )
        elif not config.eligible:
            bar.set_hatch("//")
            bar.set_facecolor("lightgrey")
    # Many configs: slant the labels rather than let them run into each other.
    many = len(configs) > 8
    ax.set_xticks(
        positions, labels=labels, fontsize=7, rotation=30 if many else 0, ha="right" if many else "center"
    )
    if not any(heights):
        ax.text(
            0.5,
            0.5,
            "no config met the SLO at any rate tried",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
    ax.set_ylabel("goodput (req/s)")
    ax.set_ylim(bottom=0)
    ax.set_title("Goodput per config" + (" (bars: mean, whiskers: 95% CI)" if has_ci else ""))
    handles = [
        Patch(facecolor="tab:green", label="winner"),
        Patch(facecolor="tab:blue", label="measured"),
        Patch(facecolor="lightgrey", hatch="//", label="failed quality gate"),
        Line2D([], [], marker="x", color="tab:red", linestyle="", label="pruned / infeasible / failed"),
    ]
    fig.legend(handles=handles, fontsize=7, loc="outside lower center", ncols=len(handles))


def _step_points(trials: list[TrialRecord], *, passed: bool) -> list[tuple[float, float]]:
    """(P99 TTFT, output tokens/s) of every step that did (or did not) meet the SLO."""
    return [
        (s.result.ttft.p99, s.result.output_token_rate)
        for t in trials
        for s in t.steps
        if s.passed == passed and s.result.ttft.p99 is not None
    ]


def _xs(points: list[tuple[float, float]]) -> list[float]:
    return [x for x, _ in points]


def _ys(points: list[tuple[float, float]]) -> list[float]:
    return [y for _, y in points]


def _plot_pareto(fig: Figure, trials: list[TrialRecord], slo: Slo) -> None:
    ax = fig.add_subplot()
    passed, missed = _step_points(trials, passed=True), _step_points(trials, passed=False)
    if not passed and not missed:
        ax.text(0.5, 0.5, "no measured steps", ha="center", va="center", transform=ax.transAxes)
        return
    if passed:
        ax.scatter(_xs(passed), _ys(passed), s=18, color="tab:blue", label="step met the SLO")
    if missed:
        ax.scatter(
            _xs(missed),
            _ys(missed),
            s=18,
            facecolors="none",
            edgecolors="tab:grey",
            label="step missed the SLO",
        )
    front = pareto_front(passed + missed)
    ax.plot(
        _xs(front),
        _ys(front),
        color="tab:red",
        marker="o",
        markersize=4,
        drawstyle="steps-post",
        label="Pareto front",
    )
    if slo.ttft_p99_s is not None:
        ax.axvline(slo.ttft_p99_s, color="tab:orange", linestyle="--", label="TTFT p99 target")
    ax.set_xlabel("P99 TTFT (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs P99 TTFT, every measured step")
    ax.legend(fontsize=7)


def _plot_kv(fig: Figure, points: list[KvPoint]) -> None:
    hit_ax = fig.add_subplot(2, 1, 1)
    pre_ax = fig.add_subplot(2, 1, 2, sharex=hit_ax)
    if not points:
        hit_ax.text(0.5, 0.5, "no measured configs", ha="center", va="center", transform=hit_ax.transAxes)
        return
    numeric = all(p.tokens is not None for p in points)
    if numeric:
        xs: list[float] = [float(p.tokens or 0) for p in points]
        pre_ax.set_xlabel("KV capacity (tokens)")
    else:
        # Without the engine's pool size the budget knob's own values are the axis, one slot each.
        names = list(dict.fromkeys(p.budget or p.config_id for p in points))
        xs = [float(names.index(p.budget or p.config_id)) for p in points]
        pre_ax.set_xticks(range(len(names)), labels=names, fontsize=7)
        pre_ax.set_xlabel("KV budget")
    hits = [(x, p.hit_rate * 100) for x, p in zip(xs, points, strict=True) if p.hit_rate is not None]
    if hits:
        hit_ax.scatter(_xs(hits), _ys(hits), color="tab:blue")
    hit_ax.set_ylabel("prefix-cache hit rate (%)")
    hit_ax.set_ylim(0, 100)
    hit_ax.set_title("Prefix-cache hit rate and preemptions vs KV budget")
    pre_ax.scatter(xs, [p.preemptions for p in points], color="tab:red")
    for x, point in zip(xs, points, strict=True):
        if not point.preemptions:
            continue  # only name the configs that preempted; the zeros would pile up unreadably
        pre_ax.annotate(
            point.config_id, (x, point.preemptions), xytext=(4, 4), textcoords="offset points", fontsize=6
        )
    pre_ax.set_ylabel("preemptions (worst step)")
    pre_ax.set_ylim(bottom=0)


def write_plots(
    plots_dir: Path,
    spec: SweepSpec,
    configs: list[ConfigSummary],
    trials: list[TrialRecord],
    winner: str | None,
) -> dict[str, Path]:
    """Render the three plots as SVG files in `plots_dir`; name -> path."""
    import matplotlib

    # Agg: no display on a sweep host; chosen here so importing kvtune never changes a caller's backend.
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    plots_dir.mkdir(parents=True, exist_ok=True)
    groups = group_trials(trials)
    draw: dict[str, tuple[Callable[[Figure], None], tuple[float, float]]] = {
        "goodput": (lambda fig: _plot_goodput(fig, configs, winner), _goodput_size(len(configs))),
        "pareto": (lambda fig: _plot_pareto(fig, trials, spec.slo), (7.0, 4.5)),
        "kv": (lambda fig: _plot_kv(fig, kv_points(configs, groups)), (7.0, 6.0)),
    }
    paths = {}
    for name, (plot, size) in draw.items():
        # Text stays text (searchable, small); a per-plot salt keeps element ids distinct once inlined.
        with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"kvtune-{name}"}):
            fig = Figure(figsize=size, layout="constrained")
            plot(fig)
            svg = io.StringIO()
            fig.savefig(svg, format="svg", metadata={"Date": None})
        paths[name] = plots_dir / f"{name}.svg"
        write_atomic(paths[name], svg.getvalue())
    return paths


def inline_svg(path: Path) -> Markup:
    """An SVG file's <svg> element, without the XML prolog and doctype that are invalid inside HTML."""
    text = path.read_text(encoding="utf-8")
    start = re.search(r"<svg[\s>]", text)
    # Our own matplotlib output, not user input: safe to embed unescaped.
    return Markup(text[start.start() :] if start else text)  # noqa: S704


# --- Templates -----------------------------------------------------------------------------------------

MARKDOWN = """\
# Sweep report: {{ name }}

- Strategy: {{ strategy }}; base profile: `{{ base_profile }}`
- SLO: {{ slo }}
- Trials run: {{ trials_run }} ({{ repeats }} repeat{{ "s" if repeats != 1 }} per config) in {{ elapsed }}
- {{ finished }}
{% if host_note %}
- Host: {{ host_note }}
{% endif %}

## Result

{% if v.winner_id %}
**Winner: `{{ v.winner_id }}`** ({{ v.winner_knobs }}): goodput {{ v.winner_goodput }}.
{% else %}
**{{ v.no_winner }}**
{% if v.closest_id %}
Closest: `{{ v.closest_id }}` ({{ v.closest_knobs }}) at {{ v.closest_rate }}, where it missed \
{{ v.closest_misses }}. {{ v.closest_why }}
{% endif %}
{% endif %}
{% if within_noise %}

> {{ within_noise }}
{% endif %}
{% if drift %}

> Host drift: {{ drift }}
{% endif %}
{% if envelope %}

> Serving envelope: {{ envelope }}
{% endif %}
{% if trial_note %}

{{ trial_note }}
{% endif %}
{% if val %}

## Validation on held-out load

**{{ val.headline }}**

{% for name, what in val.loads.items() %}
- {{ name }}: {{ what }}
{% endfor %}
{% if val.settings_note %}
- {{ val.settings_note }}
{% endif %}

| Config | Knobs | Load | Goodput | Tuned goodput | Verdict | First miss, why |
|---|---|---|---:|---:|---|---|
{% for r in val.rows %}
| {{ r.config|md }} | {{ r.knobs|md }} | {{ r.load|md }} | {{ r.goodput|md }} | {{ r.tuned|md }} |\
 {{ r.verdict|md }} | {{ r.first_miss|md }} |
{% endfor %}

Goodput of `{{ val.compared }}`:
{% for line in val.ratios %}
- {{ line }}
{% endfor %}
{% endif %}

## Plots

{% for name, title, note in plots %}
![{{ title }}](plots/{{ name }}.svg)

*{{ note }}*

{% endfor %}
## Configs

| Config |{% for c in config_columns %} {{ c.title }} |{% endfor +%}
|---|{% for c in config_columns %}{{ "---:" if c.kind == "num" else "---" }}|{% endfor +%}
{% for r in rows %}
| {{ "**" if r.winner }}`{{ r.config_id }}`{{ "**" if r.winner }} |\
{% for c in config_columns %} {{ r[c.field]|md }} |{% endfor +%}
{% endfor %}

{{ configs_note }}

## Load steps: samples, bounds and verdicts (why a step did not pass)

{% if misses %}
| Config |{% for c in miss_columns %} {{ c.title }} |{% endfor +%}
|---|{% for c in miss_columns %}{{ "---:" if c.kind == "num" else "---" }}|{% endfor +%}
{% for m in misses %}
| `{{ m.config_id }}` |{% for c in miss_columns %} {{ m[c.field]|md }} |{% endfor +%}
{% endfor %}
{% else %}
{{ no_misses }}
{% endif %}

## Pruned, infeasible and failed

{% for s in skipped %}
- `{{ s.config_id }}` ({{ s.knobs }}), {{ s.status }}{{ " (repeat %d)" % s.repeat if repeats > 1 }}: \
{{ s.reason }}
{% else %}
{{ all_measured }}
{% endfor %}
"""

HTML = """\
<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Sweep report: {{ name }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 72rem; padding: 0 1rem;
       color: #222; line-height: 1.45; }
table { border-collapse: collapse; font-size: 0.85rem; margin: 1rem 0; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.wide { min-width: 16rem; }
td.num { text-align: right; white-space: nowrap; }
tr.winner td { background: #eaf7ea; font-weight: 600; }
code { font-size: 0.9em; }
.verdict { font-size: 1.1rem; padding: 0.8rem 1rem; border-left: 4px solid #2a7; background: #f6fbf6; }
.verdict.none { border-color: #c33; background: #fdf5f5; }
.noise { padding: 0.6rem 1rem; border-left: 4px solid #e90; background: #fffaf0; }
figure { margin: 1.5rem 0; }
figure svg { max-width: 100%; height: auto; }
</style>
</head>
<body>
<h1>Sweep report: {{ name }}</h1>
<ul>
<li>Strategy: {{ strategy }}; base profile: <code>{{ base_profile }}</code></li>
<li>SLO: {{ slo }}</li>
<li>Trials run: {{ trials_run }} ({{ repeats }} repeat{{ "s" if repeats != 1 }} per config)
in {{ elapsed }}</li>
<li>{{ finished }}</li>
{% if host_note %}<li>Host: {{ host_note }}</li>{% endif %}
</ul>

<h2>Result</h2>
{% if v.winner_id %}
<p class="verdict">Winner: <code>{{ v.winner_id }}</code> ({{ v.winner_knobs }}):
goodput {{ v.winner_goodput }}.</p>
{% else %}
<p class="verdict none"><strong>{{ v.no_winner }}</strong>
{% if v.closest_id %}Closest: <code>{{ v.closest_id }}</code> ({{ v.closest_knobs }}) at {{ v.closest_rate }},
where it missed {{ v.closest_misses }}. {{ v.closest_why }}{% endif %}</p>
{% endif %}
{% if within_noise %}<p class="noise">{{ within_noise }}</p>{% endif %}
{% if drift %}<p class="noise" id="drift">Host drift: {{ drift }}</p>{% endif %}
{% if envelope %}<p class="noise" id="envelope">Serving envelope: {{ envelope }}</p>{% endif %}
{% if trial_note %}<p>{{ trial_note }}</p>{% endif %}
{% if val %}
<h2>Validation on held-out load</h2>
<p class="verdict{{ '' if val.passed else ' none' }}" id="validation-verdict">{{ val.headline }}</p>
<ul>
{% for name, what in val.loads.items() %}<li>{{ name }}: {{ what }}</li>{% endfor %}
{% if val.settings_note %}<li>{{ val.settings_note }}</li>{% endif %}
</ul>
<table id="validation">
<tr><th>Config</th><th>Knobs</th><th>Load</th><th>Goodput</th><th>Tuned goodput</th><th>Verdict</th>
<th>First miss, why</th></tr>
{% for r in val.rows %}
<tr><td>{{ r.config }}</td><td>{{ r.knobs }}</td><td>{{ r.load }}</td><td class="num">{{ r.goodput }}</td>
<td class="num">{{ r.tuned }}</td><td class="wide">{{ r.verdict }}</td>
<td class="wide">{{ r.first_miss }}</td></tr>
{% endfor %}
</table>
<p>Goodput of <code>{{ val.compared }}</code>:</p>
<ul>{% for line in val.ratios %}<li>{{ line }}</li>{% endfor %}</ul>
{% endif %}

<h2>Plots</h2>
{% for name, title, note in plots %}
<figure id="plot-{{ name }}">{{ svgs[name] }}<figcaption>{{ note }}</figcaption></figure>
{% endfor %}

<h2>Configs</h2>
<table>
<tr><th>Config</th>{% for c in config_columns %}<th>{{ c.title }}</th>{% endfor %}</tr>
{% for r in rows %}
<tr{% if r.winner %} class="winner"{% endif %}><td><code>{{ r.config_id }}</code></td>
{%- for c in config_columns %}
<td{% if c.kind != "text" %} class="{{ c.kind }}"{% endif %}>{{ r[c.field] }}</td>
{%- endfor %}</tr>
{% endfor %}
</table>
<p>{{ configs_note }}</p>

<h2>Load steps: samples, bounds and verdicts (why a step did not pass)</h2>
{% if misses %}
<table id="misses">
<tr><th>Config</th>{% for c in miss_columns %}<th>{{ c.title }}</th>{% endfor %}</tr>
{% for m in misses %}
<tr><td><code>{{ m.config_id }}</code></td>
{%- for c in miss_columns %}
<td{% if c.kind != "text" %} class="{{ c.kind }}"{% endif %}>{{ m[c.field] }}</td>
{%- endfor %}</tr>
{% endfor %}
</table>
{% else %}
<p>{{ no_misses }}</p>
{% endif %}

<h2>Pruned, infeasible and failed</h2>
{% if skipped %}
<ul>
{% for s in skipped %}
<li><code>{{ s.config_id }}</code> ({{ s.knobs }}), {{ s.status }}
{{- " (repeat %d)" % s.repeat if repeats > 1 }}: {{ s.reason }}</li>
{% endfor %}
</ul>
{% else %}
<p>{{ all_measured }}</p>
{% endif %}
</body>
</html>
"""


def _md_cell(value: object) -> str:
    """A Markdown table cell: a pipe would end the cell and a newline the row."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _environment(*, html: bool) -> jinja2.Environment:
    # Markdown is not HTML: escaping would show `&lt;` to readers of the raw file; cells use the md filter.
    env = jinja2.Environment(
        autoescape=html,  # noqa: S701
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["md"] = _md_cell
    return env


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
        "drift": _drift_text(summary),
        "envelope": summary.envelope,
        "trial_note": trial_note(spec),
        "val": validation_context(summary),
        "plots": PLOTS,
        "config_columns": CONFIG_COLUMNS,
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
    md_path, html_path = run_dir / "report.md", run_dir / "report.html"
    write_atomic(md_path, _environment(html=False).from_string(MARKDOWN).render(context))
    svgs = {name: inline_svg(path) for name, path in plots.items()}
    write_atomic(html_path, _environment(html=True).from_string(HTML).render(context | {"svgs": svgs}))
    return md_path, html_path
