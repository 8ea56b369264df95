"""Builders for fast tests of the sweep's logic (no engine, no Locust): load results, a quiet progress."""

from __future__ import annotations

from kvtune.loadgen.results import EngineDeltas, LatencySamples, LoadResult, Percentiles
from kvtune.sweep.records import TrialRecord
from kvtune.sweep.trial import TrialPlan


def load_result(
    ttft_p99: float,
    *,
    rate: float = 1.0,
    errors: int = 0,
    unsent: int = 0,
    requests: int = 300,
    preemptions: float = 0.0,
) -> LoadResult:
    """A step whose TTFT and E2E percentiles all follow `ttft_p99`, ITL a steady 50 ms. Its samples are all
    at `ttft_p99`, and 300 of them are enough to bound a p99 at 95%."""
    latency = Percentiles(
        count=requests, p50=ttft_p99 / 2, p90=ttft_p99, p95=ttft_p99, p99=ttft_p99, mean=ttft_p99 / 2
    )
    return LoadResult(
        workload="shared_prefix", arrival="poisson", users=8, window_s=30, requests=requests, errors=errors,
        ttft=latency, itl=Percentiles.of([0.05] * 10), e2e=latency, request_rate=rate,
        output_token_rate=rate * 10, achieved_rate=rate, intended_rate=rate, unsent=unsent,
        engine=EngineDeltas(preemptions=preemptions),
        samples=LatencySamples.of([ttft_p99] * requests, [0.05] * requests * 4, [ttft_p99] * requests),
    )  # fmt: skip


class Quiet:
    """A sweep progress reporter that reports nothing (the sweep loop's tests read the files instead)."""

    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None:
        pass

    def phase(self, phase: str, line: str) -> None:
        pass

    def trial_finished(self, record: TrialRecord) -> None:
        pass
