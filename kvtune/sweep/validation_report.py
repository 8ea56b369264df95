"""The validation step as the report and the console show it: one row per config and held-out load, the
verdict in plain words, and the winner's goodput ratios over the baselines with their intervals."""

from __future__ import annotations

from dataclasses import dataclass

from kvtune.sweep.records import (
    CLAIM_BASIS,
    GoodputRatio,
    LoadStanding,
    ValidatedConfig,
    ValidationSummary,
    describe,
)

ROLE_NAMES = {
    "winner": "search winner",
    "runner-up": "next-best",
    "base": "base profile (as written)",
    "vllm-defaults": "vLLM's defaults",
}


@dataclass(frozen=True)
class ValidationRow:
    config: str
    knobs: str
    load: str
    goodput: str
    tuned: str
    verdict: str
    first_miss: str


def goodput_cell(standing: LoadStanding) -> str:
    if standing.status != "done":
        return f"{standing.status}: {standing.reason or 'no reason recorded'}"
    text = f"{standing.mean_goodput:.3g} req/s"
    if standing.ci95 is not None:
        text += f" (95% CI {standing.ci95[0]:.3g}-{standing.ci95[1]:.3g}, n={len(standing.goodputs)})"
    return text


def _verdict_cell(config: ValidatedConfig) -> str:
    if config.passed is None:
        return "baseline"
    return ("holds: " if config.passed else "FAILS: ") + config.verdict


def rows(validation: ValidationSummary) -> list[ValidationRow]:
    out = []
    for config in validation.configs:
        for standing in config.loads:
            role = ROLE_NAMES[config.role]
            out.append(
                ValidationRow(
                    config=f"{role}: {config.label}" if config.knobs else role,
                    knobs=describe(config.knobs) if config.knobs else "-",
                    load=standing.load,
                    goodput=goodput_cell(standing),
                    tuned=f"{config.tuned_goodput:.3g} req/s" if config.tuned_goodput is not None else "-",
                    verdict=_verdict_cell(config),
                    first_miss=standing.first_miss or "-",
                )
            )
    return out


def ratio_text(ratio: GoodputRatio) -> str:
    """The ratio with its conservative interval; an end that nothing decided bounds is named as such
    (whose goodput was censored, or met the SLO nowhere), never left for the reader to infer."""
    name = ROLE_NAMES.get(ratio.baseline, ratio.baseline)
    low = f"{ratio.low:.2f}x" if ratio.low is not None else None
    high = f"{ratio.high:.2f}x" if ratio.high is not None else None
    if ratio.ratio is None:
        text = f"over {name} on {ratio.load}: {name} met the SLO at no rate tried"
        if low is not None:
            # Its goodput lies below the lowest rate decided as missed, so the ratio is at least this.
            text += f"; at least {low} (conservative interval {low}-unbounded: {ratio.basis})"
    else:
        text = f"over {name} on {ratio.load}: {ratio.ratio:.2f}x"
        if low is not None or high is not None:
            text += f" (conservative interval {low or 'unbounded'}-{high or 'unbounded'}: {ratio.basis})"
        elif ratio.basis != CLAIM_BASIS:
            text += " (one repeat: no interval; set validation.repeats: 2 or more)"
        else:
            text += " (no interval)"
    if ratio.open_ends and ratio.ratio is not None:
        text += f"; {ratio.open_ends}"
    return text


def headline(validation: ValidationSummary) -> str:
    """One sentence: did the winner hold, and which config did."""
    winner = validation.configs[0]
    if validation.winner_passed:
        return f"The winner held on held-out load: {winner.verdict}."
    text = f"The winner FAILED validation: {winner.verdict}."
    if validation.holding:
        held = next(c for c in validation.configs if c.label == validation.holding)
        return text + f" The next-best config that held: `{held.label}` ({describe(held.knobs)})."
    return text + " No other validated config held either."


def compared_label(validation: ValidationSummary) -> str:
    """Which config the ratios are of: the one that held, else the winner."""
    return validation.holding or validation.configs[0].label
