"""The sweep report's three SVG plots (goodput per config, the throughput/TTFT Pareto front, and KV budget
against hit rate and preemptions), drawn with matplotlib and written into the run folder for report.py.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from markupsafe import Markup

from kvtune.files import write_atomic
from kvtune.sweep.records import ConfigSummary, TrialRecord
from kvtune.sweep.shown_step import kv_tokens, representative, telling_step, worst_preemptions
from kvtune.sweep.spec import Slo, SweepSpec
from kvtune.sweep.summary import group_trials

if TYPE_CHECKING:  # matplotlib itself is imported when plotting, after the backend is chosen
    from matplotlib.figure import Figure

# Knobs that set the KV budget, in the order the KV plot falls back on when the pool size is unknown.
BUDGET_KNOBS = ("num_gpu_blocks_override", "kv_cache_memory_bytes", "gpu_memory_utilization")

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
