"""The hit-rate curve drawn: predicted hit rate against pool size, the marked pools, and any hit rates an
engine measured on the same traffic (a sweep's trials), so a reader sees how far to trust the curve."""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtune.files import write_atomic
from kvtune.traces.analysis import CurveAnalysis
from kvtune.traces.curve import HitRateCurve, log_spaced


@dataclass(frozen=True)
class Measured:
    """A hit rate an engine reported at a pool size."""

    pool_blocks: int
    hit_rate: float
    label: str


def curve_figure(
    curve: HitRateCurve, analysis: CurveAnalysis, measured: Sequence[Measured] = (), fmt: str = "svg"
) -> bytes:
    """The plot as SVG or PNG bytes."""
    import matplotlib

    # Agg: no display on a server; chosen here so importing kvtune never changes a caller's backend.
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    low = max(1, min([analysis.smallest_pool, *(m.pool_blocks for m in measured)]))
    high = max([analysis.everything_pool, *(m.pool_blocks for m in measured)]) * 2
    sizes = log_spaced(low, high, 400)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kvtune-curve"}):
        fig = Figure(figsize=(7.5, 4.5), layout="constrained")
        ax = fig.add_subplot()
        ax.step(sizes, [curve.hit_rate(s) for s in sizes], where="post", label="predicted (one at a time)")
        ax.axhline(analysis.ideal_hit_rate, color="grey", linestyle=":", label="ideal (infinite pool)")
        for pool, style, name in (
            (analysis.knee_pool, "--", "knee"),
            (analysis.target_pool, "-.", f"{analysis.target_share:.0%} of ideal"),
        ):
            ax.axvline(pool, color="tab:green", linestyle=style, alpha=0.7, label=f"{name}: {pool:,} blocks")
        if analysis.profile_pool is not None:
            ax.axvline(analysis.profile_pool, color="tab:purple", alpha=0.7, label="the profile's pool")
        if measured:
            ax.scatter(
                [m.pool_blocks for m in measured],
                [m.hit_rate for m in measured],
                color="tab:red",
                zorder=3,
                label="measured by the engine",
            )
            for point in measured:
                ax.annotate(point.label, (point.pool_blocks, point.hit_rate), fontsize=7, xytext=(4, -10),
                            textcoords="offset points")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel(f"KV pool (usable blocks of {analysis.block_size} tokens)")
        ax.set_ylabel("prefix-cache hit rate (prompt tokens)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        out = io.BytesIO()
        fig.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
    return out.getvalue()


def write_curve_plots(
    folder: Path, curve: HitRateCurve, analysis: CurveAnalysis, measured: Sequence[Measured] = ()
) -> list[Path]:
    """curve.svg and curve.png in FOLDER."""
    paths = []
    for fmt in ("svg", "png"):
        path = folder / f"curve.{fmt}"
        write_atomic(path, curve_figure(curve, analysis, measured, fmt))
        paths.append(path)
    return paths
