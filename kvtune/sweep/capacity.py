"""A capacity plan from a sweep's validated winner: the replicas that serve a peak rate within the SLO, the
GPUs (or cores) that takes, and the signal and threshold an autoscaler scales it on (`kvtune plan`).

Pure arithmetic over what the run recorded; the command reads the run folder and writes the overlay.

- The bound is what one replica is trusted to serve: the winner's claimed rate that held on held-out load
  (validation), lowered to the low end of its 95% interval when the search had repeats. A censored goodput
  (no decided miss above it) is refused: it only says the replica serves at least that much, and the
  threshold below needs a missed step to be derived from.
- The threshold comes from the engine's own gauges at the goodput step and at the first step decided to
  miss the SLO above it: of the signals an autoscaler can read (`observability.scaling_signal`), the one
  whose value grows most (relative to its value at the miss) between the two, split at the midpoint. One
  replica at its goodput sits below it and at the first missed rate above it, so KEDA's
  ceil(sum / threshold) adds a replica between the two.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvtune.config_errors import ConfigError, cut
from kvtune.observability.scaling_signal import SIGNALS, SignalName, scaling_query
from kvtune.platform import CPU_BIND_MODES, parse_core_lists
from kvtune.profile import EngineProfile
from kvtune.sweep.records import RunSummary, StepRecord, TrialRecord, describe

# Rates are decimal figures (req/s) stored as floats: 4.9 / 0.7 is 7.000000000000001, not 7. A quotient
# this close to a whole number is that number.
_WHOLE_TOLERANCE = 1e-9
_MEAN_FIELDS = ", ".join(signal.mean_field for signal in SIGNALS.values())


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GoodputBound(_Model):
    """What one replica of the winner is trusted to serve within the SLO, and where the figure comes from."""

    config_id: str
    knobs: dict[str, Any] = Field(default_factory=dict)
    claimed: float = Field(description="the search goodput the validation step tested and saw hold, req/s")
    ci95_low: float | None = Field(None, description="low end of the search goodput's 95% interval")
    repeats: int = Field(description="search repeats of the winner")
    ceiling: float = Field(description="the lowest rate the search decided to miss the SLO, req/s")
    rate: float = Field(description="the bound: the claim, lowered to ci95_low when that is lower")
    verdict: str = Field("", description="the validation step's verdict on the winner")

    def line(self) -> str:
        return (
            f"- One replica of {self.config_id} ({describe(self.knobs)}) is trusted with {self.rate:.3g} "
            f"req/s: {self.basis}; the search saw it miss at {self.ceiling:.3g} req/s."
        )

    @property
    def basis(self) -> str:
        claim = f"the claimed {self.claimed:.3g} req/s held on held-out load"
        if self.ci95_low is not None and self.ci95_low < self.claimed:
            return f"{claim}, lowered to its 95% interval's low end over {self.repeats} repeats"
        return claim


class SignalGap(_Model):
    """One signal at the goodput step and at the first missed step (over repeats: the highest value seen
    passing, the lowest seen missing)."""

    signal: SignalName
    passing: float | None = Field(None, description="time mean at the goodput step (highest over repeats)")
    missing: float | None = Field(
        None, description="time mean at the first missed step (lowest over repeats)"
    )

    @property
    def split(self) -> float | None:
        """A value strictly between the two (their midpoint, in the fewest figures from 3 that stay
        between); None when the signal does not separate them (no higher at the miss)."""
        if self.passing is None or self.missing is None:
            return None
        low, high = self.passing, self.missing
        middle = (low + high) / 2
        if not low < middle < high:  # equal, lower at the miss, or too close for a float between
            return None
        for figures in range(3, 18):
            shown = float(f"{middle:.{figures}g}")
            if low < shown < high:
                return shown
        return middle

    @property
    def gap(self) -> float | None:
        """(miss - pass) / miss: how much of the value at the miss the pass lacks; None when it does not
        separate."""
        if self.split is None or self.passing is None or self.missing is None:
            return None
        return (self.missing - self.passing) / self.missing


class Threshold(_Model):
    """The signal chosen, its threshold per replica and the table it was chosen from."""

    signal: SignalName
    value: float = Field(
        description="the signal's value per replica to scale at: the midpoint of the two, in the fewest "
        "figures (from 3) that stay strictly between them"
    )
    window_s: float = Field(description="the averaging window: one measured window of the goodput step")
    pass_rate: float = Field(description="the goodput step's rate, req/s")
    miss_rate: float = Field(description="the first missed step's rate, req/s")
    table: list[SignalGap]

    @property
    def window(self) -> str:
        """The averaging window as Prometheus writes a duration."""
        return f"{max(1, round(self.window_s))}s"

    def lines(self) -> list[str]:
        """Why this signal and value, in Markdown: the signal, the threshold and the table it came from."""
        signal = SIGNALS[self.signal]
        lines = [
            f"- Autoscale on `{self.signal}` ({signal.metric}, {signal.meaning}), its mean over "
            f"{self.window} per replica: threshold **{self.value!r}**. One replica at its goodput "
            f"({self.pass_rate:.3g} req/s) sat below it, at the first missed rate "
            f"({self.miss_rate:.3g} req/s) above it; of the signals it grew most "
            "between the two (relative to its value at the miss).",
            "",
            f"| signal | at {self.pass_rate:.3g} req/s (passed) | at {self.miss_rate:.3g} req/s (missed) "
            "| gap |",
            "|---|---:|---:|---:|",
        ]
        for row in self.table:
            gap = "does not separate" if row.gap is None else f"{row.gap:.0%}"
            mark = " (chosen)" if row.signal == self.signal else ""
            lines.append(f"| {row.signal}{mark} | {_value(row.passing)} | {_value(row.missing)} | {gap} |")
        return lines


class CapacityPlan(_Model):
    """Replicas, devices and autoscaling for a peak rate, with every figure they come from."""

    run: str = Field(description="the sweep's name")
    slo: str
    bound: GoodputBound
    peak_rate: float
    min_rate: float | None = None
    replicas: int = Field(description="replicas that serve the peak rate within the SLO")
    min_replicas: int = Field(description="replicas the autoscaler keeps for the least rate (at least 1)")
    device: str = Field(description="cuda or cpu")
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    devices_per_replica: int | None = Field(
        description="GPUs (cuda: TP x PP x DP) or cores (cpu: those its engine computes on; None when the "
        "run does not say) one replica takes"
    )
    threshold: Threshold
    note: str | None = Field(None, description="how the trials' settings differ from the deployed engine's")

    @property
    def served_rate(self) -> float:
        return self.replicas * self.bound.rate

    @property
    def headroom(self) -> float:
        """Share of the peak the replicas serve beyond it (0.05: 5%)."""
        return headroom(self.replicas, self.bound.rate, self.peak_rate)

    @property
    def unit(self) -> str:
        return "GPU" if self.device == "cuda" else "core"

    @property
    def devices(self) -> int | None:
        return None if self.devices_per_replica is None else self.replicas * self.devices_per_replica

    @property
    def window(self) -> str:
        return self.threshold.window

    def devices_text(self) -> str:
        sizes = (
            f"TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} x DP "
            f"{self.data_parallel_size}"
        )
        if self.device == "cuda":
            return f"{self.devices} GPUs ({self.replicas} replicas x {sizes})"
        if self.devices_per_replica is None:
            return (
                f"{self.replicas} replicas on CPU, each on the cores its engine had in the sweep (the run "
                f"does not record how many; {sizes} ranks, a core each at least)"
            )
        return f"{self.devices} cores ({self.replicas} replicas x {self.devices_per_replica} cores)"

    def lines(self) -> list[str]:
        """The plan as Markdown: what `kvtune plan` prints."""
        least = (
            f"; {self.min_replicas} serve the least rate, {self.min_rate:.3g} req/s"
            if self.min_rate is not None
            else ""
        )
        return [
            f"- **{self.replicas} replicas** serve {self.peak_rate:.3g} req/s within the SLO ({self.slo}): "
            f"{self.served_rate:.3g} req/s, {self.headroom:.0%} headroom{least}; the autoscaler keeps "
            f"between {self.min_replicas} and {self.replicas}.",
            self.bound.line(),
            f"- {self.devices_text()}.",
            *([f"- The gauges were read on the search's trial engines: {self.note}"] if self.note else []),
            *self.threshold.lines(),
        ]


def replica_lines(summary: RunSummary, trials: list[TrialRecord]) -> list[str]:
    """The sweep report's capacity section: what one replica of the winner is trusted with and the signal
    to scale it on, or why this run gives no plan."""
    try:
        bound = goodput_bound(summary, "summary.json")
        winner = [t for t in trials if t.config_id == bound.config_id and t.status == "done"]
        threshold = choose_threshold(winner, "the winner's trials")
    except ConfigError as exc:
        return [f"No capacity plan can be made from this run: {exc}"]
    note = summary.validation.settings_note if summary.validation else None
    return [
        bound.line(),
        *([f"- The gauges were read on the search's trial engines: {note}"] if note else []),
        *threshold.lines(),
        "",
        "Replicas for a peak rate R, and a values overlay for the chart: "
        "`kvtune plan RUN_DIR --peak-rate R`.",
    ]


def _value(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.3g}"


# ---- the bound ------------------------------------------------------------------------------------------


def goodput_bound(summary: RunSummary, source: str) -> GoodputBound:
    """The winner's validated goodput, conservatively: ConfigError (SOURCE names the summary) when the run
    gives none to plan from."""
    validation = summary.validation
    if validation is None:
        raise ConfigError(
            f"{source}: the sweep ran without validation, so no goodput was seen to hold on held-out load; "
            "run the sweep with validation (validation.enabled: true in the spec)"
        )
    winner = next((c for c in validation.configs if c.role == "winner"), None)
    if winner is None:
        raise ConfigError(
            f"{source}: validation.configs has no winner; the file is damaged: sweep --resume the run "
            "to write it again"
        )
    if not validation.winner_passed or not winner.passed:
        held = next((c for c in validation.configs if c.label == validation.holding), None)
        after = (
            f"; the next-best config that held is {held.label} ({describe(held.knobs)}), but a plan is "
            "made from a validated winner only: sweep again (its knobs in the base profile, or more repeats)"
            if held is not None and held.label != winner.label
            else "; no other config held either: sweep again before planning"
        )
        raise ConfigError(
            f"{source}: validation.winner_passed: the winner {winner.label} failed validation on held-out "
            f"load ({cut(winner.verdict, 200)}){after}"
        )
    config = next((c for c in summary.configs if c.config_id == winner.label), None)
    if config is None or winner.tuned_goodput is None:
        raise ConfigError(
            f"{source}: the validated winner {winner.label} has no search figures in configs; the file is "
            "damaged: sweep --resume the run to write it again"
        )
    if config.censored or config.goodput_ceiling is None:
        raise ConfigError(
            f"{source}: the winner {config.config_id}'s goodput {config.mean_goodput:.3g} req/s is censored: "
            "no load step above it was decided to miss the SLO, so it is only a lower bound (and no missed "
            "step gives a threshold); remove or raise load.rate_cap in the spec and sweep again"
        )
    low = config.ci95[0] if config.ci95 is not None else None
    rate = min(winner.tuned_goodput, low) if low is not None else winner.tuned_goodput
    if not rate > 0:
        why = f" (the low end of its 95% interval over {len(config.goodputs)} repeats)" if low == rate else ""
        raise ConfigError(
            f"{source}: the winner {config.config_id}'s validated goodput bound is 0 req/s{why}: no number "
            "of replicas serves a rate with it; sweep again with more repeats (repeats in the spec)"
        )
    return GoodputBound(
        config_id=config.config_id,
        knobs=config.knobs,
        claimed=winner.tuned_goodput,
        ci95_low=low,
        repeats=len(config.goodputs),
        ceiling=config.goodput_ceiling,
        rate=rate,
        verdict=winner.verdict,
    )


# ---- the arithmetic -------------------------------------------------------------------------------------


def replicas_for(rate: float, bound: float) -> int:
    """Replicas of BOUND req/s each that serve RATE: ceil(rate / bound), a rate of exactly k bounds being k
    (never 0: the replicas that serve a rate above 0)."""
    _check_positive(rate, "rate")
    _check_positive(bound, "bound")
    quotient = rate / bound
    nearest = round(quotient)
    if nearest >= 1 and math.isclose(quotient, nearest, rel_tol=_WHOLE_TOLERANCE, abs_tol=0.0):
        return nearest
    return max(1, math.ceil(quotient))


def headroom(replicas: int, bound: float, rate: float) -> float:
    """What REPLICAS of BOUND req/s serve beyond RATE, as a share of it: 6 x 7 / 40 - 1 = 0.05."""
    return replicas * bound / rate - 1


def _check_positive(value: float, name: str) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} {value}: give a finite rate above 0 req/s")


def devices_per_replica(profile: EngineProfile, trials: list[TrialRecord]) -> int | None:
    """GPUs one replica takes (TP x PP x DP); on CPU the cores its engine computes on: an explicit
    cpu_threads_bind's, else those a parallel sweep gave its trials (None when the run does not say)."""
    ranks = profile.tensor_parallel_size * profile.pipeline_parallel_size * profile.data_parallel_size
    if profile.device == "cuda":
        return ranks
    bind = profile.cpu_threads_bind
    if bind is not None and bind not in CPU_BIND_MODES:
        return _cores(bind)
    placed = {t.devices for t in trials if t.devices and t.devices.startswith("cores ")}
    if len(placed) == 1:
        return _cores(placed.pop().removeprefix("cores "))
    return None


def _cores(text: str) -> int | None:
    """Cores in a core list as vLLM's thread binding writes it ("0-1|2,4": 4); None when it is none."""
    try:
        lists = parse_core_lists(text)
    except ValueError:
        return None
    return sum(last - first + 1 for ranges in lists for first, last in ranges)


# ---- the threshold --------------------------------------------------------------------------------------


def signal_table(records: list[TrialRecord], source: str) -> tuple[list[SignalGap], float, float, float]:
    """Each signal at the goodput step and the first missed step over the winner's repeats; with the
    rates of the two steps (the lowest passing, the highest missing seen) and one window's seconds. Every
    sample at the goodput's rate counts (its second look too): one replica at its goodput must sit below
    the threshold on each of them."""
    pairs: list[tuple[StepRecord, StepRecord]] = []
    for record in records:
        best, miss_rate = record.best_step, record.first_decided_miss
        if record.status != "done" or best is None or miss_rate is None:
            continue
        miss = next(s for s in record.steps if s.decided == "fail" and s.rate == miss_rate)
        pairs += [(step, miss) for step in record.steps if step.passed and step.rate == best.rate]
    if not pairs:
        raise ConfigError(
            f"{source}: no search trial of the winner has both a passing step and a decided miss above it "
            "(its trial records are missing or damaged); sweep again"
        )
    table = []
    for name, signal in SIGNALS.items():
        passing = [_mean(p.result.engine, signal.mean_field) for p, _m in pairs]
        missing = [_mean(m.result.engine, signal.mean_field) for _p, m in pairs]
        seen_pass = [v for v in passing if v is not None]
        seen_miss = [v for v in missing if v is not None]
        table.append(
            SignalGap(
                signal=name,
                passing=max(seen_pass) if seen_pass else None,
                missing=min(seen_miss) if seen_miss else None,
            )
        )
    pass_rate = min(p.rate for p, _m in pairs)
    miss_rate = max(m.rate for _p, m in pairs)
    window_s = min(p.result.window_s / p.result.windows for p, _m in pairs)
    return table, pass_rate, miss_rate, window_s


def _mean(engine: object, field: str) -> float | None:
    value = getattr(engine, field)
    return None if value is None else float(value)


def choose_threshold(records: list[TrialRecord], source: str) -> Threshold:
    """The signal that separates the goodput step from the first missed one most, split at the midpoint;
    ConfigError naming SOURCE when none does or the records predate the gauge means."""
    table, pass_rate, miss_rate, window_s = signal_table(records, source)
    if all(row.passing is None and row.missing is None for row in table):
        raise ConfigError(
            f"{source}: the winner's load steps carry no engine gauge means ({_MEAN_FIELDS}): they were "
            "measured by an older kvtune; sweep again to derive a threshold"
        )
    separating = [(row, split) for row in table if (split := row.split) is not None]
    if not separating:
        measured = "; ".join(f"{row.signal} {_value(row.passing)} -> {_value(row.missing)}" for row in table)
        raise ConfigError(
            f"{source}: no engine signal is higher at the first missed step ({miss_rate:.3g} req/s) than "
            f"at the goodput step ({pass_rate:.3g} req/s): {measured}; no threshold separates them: sweep "
            "again with longer load steps (load.step_seconds) for steadier means"
        )
    # max keeps the first of equal gaps: SIGNALS' order breaks ties.
    chosen, split = max(separating, key=lambda found: found[0].gap or 0.0)
    return Threshold(
        signal=chosen.signal,
        value=split,
        window_s=window_s,
        pass_rate=pass_rate,
        miss_rate=miss_rate,
        table=table,
    )


# ---- the plan -------------------------------------------------------------------------------------------


def make_plan(
    summary: RunSummary,
    profile: EngineProfile,
    records: list[TrialRecord],
    *,
    peak_rate: float,
    min_rate: float | None = None,
    gpus_per_node: int | None = None,
    run: str = "RUN_DIR",
) -> CapacityPlan:
    """The plan for PEAK_RATE (and MIN_RATE) from the run's summary, the winner's profile (best.yaml) and
    its search trials; ConfigError naming the file (RUN names the folder), field and fix for anything it
    cannot plan from."""
    _check_positive(peak_rate, "--peak-rate")
    if min_rate is not None:
        _check_positive(min_rate, "--min-rate")
        if min_rate > peak_rate:
            raise ConfigError(
                f"--min-rate {min_rate:g} is above --peak-rate {peak_rate:g}; give a --min-rate at most "
                "the peak"
            )
    bound = goodput_bound(summary, f"{run}/summary.json")
    per_replica = devices_per_replica(profile, records)
    if gpus_per_node is not None:
        if profile.device != "cuda":
            raise ConfigError(
                f"--gpus-per-node {gpus_per_node}: the winner runs on CPU (device cpu), it takes no GPUs; "
                "drop --gpus-per-node"
            )
        if per_replica is not None and per_replica > gpus_per_node:
            raise ConfigError(
                f"--gpus-per-node {gpus_per_node}: one replica takes {per_replica} GPUs "
                f"(tensor_parallel_size {profile.tensor_parallel_size} x pipeline_parallel_size "
                f"{profile.pipeline_parallel_size} x "
                f"data_parallel_size {profile.data_parallel_size}) and the chart places a replica on one "
                "node; lower those sizes in the profile and sweep again, or plan for larger nodes"
            )
    threshold = choose_threshold(records, f"{run}/trials")
    return CapacityPlan(
        run=summary.name,
        slo=", ".join(f"{key} {value:g}" for key, value in summary.slo.items() if _number(value)),
        bound=bound,
        peak_rate=peak_rate,
        min_rate=min_rate,
        replicas=replicas_for(peak_rate, bound.rate),
        min_replicas=replicas_for(min_rate, bound.rate) if min_rate is not None else 1,
        device=profile.device,
        tensor_parallel_size=profile.tensor_parallel_size,
        pipeline_parallel_size=profile.pipeline_parallel_size,
        data_parallel_size=profile.data_parallel_size,
        devices_per_replica=per_replica,
        threshold=threshold,
        note=summary.validation.settings_note if summary.validation else None,
    )


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---- the overlay ----------------------------------------------------------------------------------------


def overlay(plan: CapacityPlan) -> dict[str, Any]:
    """The chart values the plan sets, laid over the run's values.yaml (`-f values.yaml -f THIS`). The
    autoscalers' enabled flags are left as the user has them: this plan does not switch autoscaling on."""
    chosen = plan.threshold
    scale = {"minReplicas": plan.min_replicas, "maxReplicas": plan.replicas}
    return {
        "replicas": plan.replicas,
        "autoscaling": {
            "signal": chosen.signal,
            "window": plan.window,
            "keda": {**scale, "threshold": chosen.value},
            "hpa": {**scale, "target": chosen.value},
        },
    }


def overlay_header(plan: CapacityPlan, values_file: str, overlay_file: str) -> list[str]:
    """Comment lines above the overlay: what was measured, and how to use it."""
    bound, chosen = plan.bound, plan.threshold
    values = "; ".join(f"{row.signal} {_value(row.passing)} -> {_value(row.missing)}" for row in chosen.table)
    query = scaling_query(chosen.signal, "...", plan.window)
    return [
        f"Capacity plan of sweep {plan.run} (kvtune plan): {plan.peak_rate:.3g} req/s at peak within the SLO "
        f"({plan.slo})",
        f"Bound: {bound.rate:.3g} req/s per replica of {bound.config_id}: {bound.basis}",
        f"Replicas: {plan.replicas} serve {plan.served_rate:.3g} req/s ({plan.headroom:.0%} headroom); "
        f"{plan.devices_text()}",
        f"Threshold: {chosen.signal} {chosen.value!r} per replica, the midpoint of its mean at the "
        f"goodput step ({chosen.pass_rate:.3g} req/s) and at the first missed step ({chosen.miss_rate:.3g} "
        f"req/s); measured: {values}",
        f"KEDA reads {query}, {{...}} selecting the engine's pods; the HPA reads the adapter's metric",
        f"Use: helm upgrade --install NAME helm/kvtune -f {values_file} -f {overlay_file} "
        "--set autoscaling.keda.enabled=true (or autoscaling.hpa.enabled=true)",
    ]
