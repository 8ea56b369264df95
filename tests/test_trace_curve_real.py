"""The hit-rate curve against real vLLM engines: a generated multi-turn trace replayed through `kvtune load`
in trace order at three pool sizes spanning the knee, the one chosen by `kvtune trace curve` among them, each
prediction within 2 points of the engine's own prefix-cache counters; and with requests in flight, the
block-pool replay's prediction beside the engine's, its error stated.

What is asserted is the mechanism (which blocks the engine kept, read from its counters), never how fast the
host served: the replay waits for every answer, whatever its speed.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from benchmarks.trace_curve import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    PoolResult,
    bench_shape,
    measure_pool,
    pool_profile,
    write_chat_trace,
)
from kvtune.traces.analysis import trace_curve
from kvtune.traces.format import read_trace
from kvtune.traces.tokens import BlockMapping
from tests.helpers import ARTIFACTS

pytestmark = pytest.mark.engine

# Points of hit rate the one-pass curve may be off by (the target), and with four requests in flight
# the block-pool replay, whose finishing order is a simplification (benchmarks/RESULTS.md has the spread).
TOLERANCE = 0.02
IN_FLIGHT_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def chat_trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "chat.jsonl"
    # 20 conversations, 57 requests of 4-token answers: enough sharing between turns that pools of 8-40
    # blocks keep different parts (a third to two thirds of the prompt tokens), small enough to replay four
    # times in a few minutes. `make bench-trace` replays a larger one.
    write_chat_trace(path, bench_shape(20, output_tokens=4))
    return path


def curve_json(trace: Path, profile: Path) -> dict[str, object]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtune.cli",
            "trace",
            "curve",
            str(trace),
            "--profile",
            str(profile),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    data: dict[str, object] = json.loads(result.stdout)
    return data


@dataclass(frozen=True)
class Measured:
    advice: dict[str, object]
    target: int
    knee: int
    results: list[PoolResult]

    def shown(self) -> str:
        return "\n".join(
            f"pool {r.pool_blocks}, {r.in_flight} in flight: predicted {r.predicted:.4f} "
            f"engine {r.engine:.4f} ({r.error_points:+.2f} points)"
            for r in self.results
        )


@pytest.fixture(scope="module")
def measured(chat_trace_file: Path, model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Measured:
    # The user's step: the curve for a profile of this block size, read as a recommendation.
    profile = tmp_path_factory.mktemp("profile") / "profile.yaml"
    profile.write_text(
        yaml.safe_dump(pool_profile(64, "curve-check").model_dump(mode="json", exclude_none=True))
    )
    advice = curve_json(chat_trace_file, profile)
    smallest, knee, target = (int(str(advice[key])) for key in ("smallest_pool", "knee_pool", "target_pool"))
    # Three engines (each start is most of a minute here): `make bench-trace` measures more pools.
    pools = sorted({smallest + 1, knee, target})
    assert len(pools) == 3 and pools[0] < knee < pools[-1], advice

    trace = read_trace(chat_trace_file)
    traced = trace_curve(trace, BlockMapping(BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE, MAX_MODEL_LEN))
    log_dir = ARTIFACTS / "trace-curve"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[PoolResult] = []
    for pool in pools:
        # At the knee, the same engine (its cache reset) also serves the trace with four requests in flight.
        in_flight = (1, 4) if pool == knee else (1,)
        results.extend(measure_pool(chat_trace_file, traced, pool, in_flight, log_dir, model_path))
    # The figures of this run, for whoever reads the artefacts: each pool's prediction and the engine's.
    figures = [dataclasses.asdict(result) for result in results]
    (log_dir / "results.json").write_text(json.dumps(figures, indent=2) + "\n")
    return Measured(advice, target, knee, results)


def test_the_curve_predicts_the_engine_at_pools_spanning_the_knee(measured: Measured) -> None:
    rows = measured.advice["rows"]
    assert isinstance(rows, list)
    recommended = next(row for row in rows if "target" in row["marks"])
    assert recommended["cost"]["num_gpu_blocks_override"] == measured.target + 1
    shown = measured.shown()
    sequential = [r for r in measured.results if r.in_flight == 1]
    for result in measured.results:
        # Every prompt token reached the engine once, and nothing else did.
        assert result.queries == result.expected_queries, shown
    for result in sequential:
        assert abs(result.predicted - result.engine) <= TOLERANCE, shown
    # The pools behave differently: the trace spans the knee.
    assert sequential[-1].engine - sequential[0].engine > 0.2, shown
    # The recommended pool, applied, reaches the hit rate the curve promised for it.
    applied = next(r for r in sequential if r.pool_blocks == measured.target)
    ideal = float(str(measured.advice["ideal_hit_rate"]))
    assert applied.engine >= float(str(measured.advice["target_share"])) * ideal - TOLERANCE, shown


def test_with_requests_in_flight_the_block_pool_replay_predicts_the_engine(measured: Measured) -> None:
    result = next(r for r in measured.results if r.in_flight == 4)
    assert result.pool_blocks == measured.knee
    assert abs(result.predicted - result.engine) <= IN_FLIGHT_TOLERANCE, measured.shown()
