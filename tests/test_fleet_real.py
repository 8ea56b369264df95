"""The capacity plan proved on real engines (benchmarks/fleet.py, the same driver): a sweep pinned to one core
measures one replica's goodput g, `kvtune plan` sizes two replicas for a rate between g and 2g, two replicas
behind kvtune's router are decided to meet the SLO there and one replica decided to miss it, and the
autoscaling signal, as a real Prometheus answers the chart's own query, stays below the planned threshold at
g and crosses it no later than the first missed step.

What is asserted is the mechanism, relative to what this host measured: g itself (and so every rate) moves
with the host's speed, and the proof holds relative to it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fleet import Proof, Row, run_proof
from kvtune.observability.scaling_signal import scaling_query
from kvtune.sweep.capacity import replicas_for
from kvtune.sweep.confidence import combine
from tests.helm_chart import pod_matchers
from tests.helpers import ARTIFACTS
from tests.test_sweep_real import processes_mentioning

# A sweep (one eager engine, then its validation), two `kvtune up` runs and about ten load steps. The rate
# one replica serves is measured first and the fleet's verdicts are relative to it: the host must not change
# between them (quiet_host: after every other test).
pytestmark = [pytest.mark.engine, pytest.mark.quiet_host, pytest.mark.timeout(3000)]


def decided_by_the_bounds(row: Row) -> None:
    """The row's verdict is the confidence rule's: each target's bound against its target, combined."""
    assert combine(row.verdicts) == row.decision, row
    for verdict in row.verdicts:
        if verdict.decision == "pass":
            assert verdict.upper is not None and verdict.upper <= verdict.target, verdict
        elif verdict.decision == "fail":
            assert verdict.lower is not None and verdict.lower > verdict.target, verdict


def test_two_replicas_serve_the_planned_peak_one_misses_it_and_the_signal_crosses_no_later(
    tmp_path: Path,
) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    log_path = ARTIFACTS / "fleet-real.log"
    with log_path.open("w") as log:
        proof: Proof = run_proof(tmp_path, lambda line: print(line, file=log, flush=True))
    shown = f"{proof.table()}\n(log: {log_path}, figures: {tmp_path / 'fleet.json'})"

    # The plan: a rate strictly between one bound and two takes two replicas.
    assert proof.bound < proof.peak_rate < 2 * proof.bound, shown
    assert proof.replicas == replicas_for(proof.peak_rate, proof.bound) == 2, shown
    assert proof.ceiling > proof.bound, shown  # the sweep's goodput is bracketed by a decided miss

    # Two replicas, one core each, behind the router: decided to meet the SLO at the peak.
    fleet = proof.at("fleet", proof.peak_rate)
    assert fleet is not None and fleet.replicas == 2, shown
    decided_by_the_bounds(fleet)
    assert fleet.decision == "pass", shown
    # One replica on one core: decided to miss it, by a target whose lower bound is above it.
    single = proof.at("single", proof.peak_rate)
    assert single is not None and single.replicas == 1, shown
    decided_by_the_bounds(single)
    assert single.decision == "fail", shown
    missed = [v.name for v in single.verdicts if v.decision == "fail"]
    assert missed, shown

    # The signal, as Prometheus answers the chart's own query: below the threshold through the step at g ...
    assert proof.query == scaling_query(proof.signal, pod_matchers(), proof.window), shown
    # One replica was decided to serve some rate of the rising load, and the signal stayed below the
    # threshold there. At g itself, on arrivals the sweep never saw, the verdict may sit at the SLO's edge
    # (a highest passing rung has little margin by construction: one run read TTFT p90 2.39-4.58 s, undecided,
    # with a 3-s target), so g is held to the signal alone, whatever its verdict.
    served = [row for row in proof.single() if row.decision == "pass"]
    assert served, shown
    for row in served:
        decided_by_the_bounds(row)
        assert row.answers and max(row.answers) < proof.threshold, shown
    at_g = proof.at("single", proof.bound)
    assert at_g is not None and at_g.answers, shown
    assert max(at_g.answers) < proof.threshold, shown
    # ... and above it at or before the first step of the rising load decided to miss.
    first_miss = proof.first_single_miss()
    crossed = proof.crossed_at()
    assert first_miss is not None and crossed is not None, shown
    assert crossed.rate <= first_miss.rate, shown
    assert proof.problems() == [], shown

    # Every engine, router, front and Prometheus of the run is stopped.
    assert processes_mentioning(str(tmp_path)) == []
