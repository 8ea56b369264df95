"""A trace replayed on a real engine: in trace order one request at a time (the engine's prefix cache hits
what the trace shares), at the trace's own times (never early, never bunched, lateness reported), and faster
than the engine serves (sent late, each latency counted from the trace's time).

No verdict here depends on how fast the host serves: each assertion is about when requests were sent
relative to when they were due, and what the engine's own counters say.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtune.engine import Engine
from kvtune.loadgen.runner import LoadSpec, run_load
from kvtune.loadgen.trace_workload import TraceArgs, trace_arrivals
from kvtune.traces.format import write_trace
from kvtune.traces.synthetic import ChatTraceShape, chat_trace

pytestmark = pytest.mark.engine

# Trace blocks of the engine's own block size (128, the shipped profile's): the engine's blocks are the
# trace's. One system prompt of two blocks shared by every conversation, a second turn resending the first.
SHAPE = ChatTraceShape(conversations=4, system_prompts=1, system_tokens=256, turns=2, user_tokens=64,
                       output_tokens=8, block_size=128, conversation_rate=1.0, think_s=2.0,
                       seed=5)  # fmt: skip
# Requests due this far apart are never sent closer than half of it, unless the earlier one was late.
APART_S = 0.5


def samples(log_dir: Path) -> list[dict[str, Any]]:
    (run_dir,) = log_dir.iterdir()
    records = [
        json.loads(line) for path in run_dir.glob("samples.*.jsonl") for line in path.read_text().splitlines()
    ]
    return sorted(records, key=lambda r: r["intended"])


def lateness(record: dict[str, Any]) -> float:
    late: float = record["sent"] - record["intended"]
    return late


def test_a_trace_is_replayed_in_order_at_its_own_times_and_late_when_the_engine_falls_behind(
    default_engine: Engine, tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    path = tmp_path / "chat.jsonl"
    with path.open("w") as file:
        count = write_trace(file, chat_trace(SHAPE), SHAPE.block_size)
    trace = {"trace-file": str(path)}

    def replay(name: str, seed: int, **load: Any) -> tuple[Any, list[dict[str, Any]]]:
        (tmp_path / name).mkdir()
        spec = LoadSpec(url=default_engine.url, workload="trace", workload_args=trace | load.pop("args", {}),
                        seed=seed, **load)  # fmt: skip
        result = run_load(spec, log_dir=tmp_path / name)
        records = samples(tmp_path / name)
        assert result.errors == 0 and all(r["error"] is None for r in records), result.error_examples
        assert result.requests == len(records) == count
        return result, records

    # 1. Closed loop, one user: the trace in its order, each request once the one before was answered.
    closed, records = replay("closed", seed=101, arrival="closed", users=1)
    by_send = sorted(records, key=lambda r: r["sent"])
    assert [r["trace_index"] for r in by_send] == list(range(count))
    for earlier, later in itertools.pairwise(by_send):
        assert later["sent"] >= earlier["intended"] + earlier["e2e"] - 0.01
    # ignore_eos: every answer has the trace's output length.
    assert all(r["completion_tokens"] == SHAPE.output_tokens for r in records)
    # The engine's own prefix cache hits what the trace shares (the system prompt, then each history).
    engine = closed.engine
    assert closed.target_reuse is not None and closed.target_reuse > 0.3
    assert engine.hit_rate is not None and engine.prefix_cache_hits > 0
    assert engine.hit_rate == pytest.approx(closed.target_reuse, abs=0.02)
    record_property("closed_hit_rate_vs_target", (engine.hit_rate, closed.target_reuse))

    # 2. At the trace's own times, a user for every request: due at the run's start + the trace's offset.
    paced, records = replay("paced", seed=102, users=count)
    due = trace_arrivals(TraceArgs.of(trace), "trace", 64)
    start = records[0]["intended"]
    assert [r["intended"] - start for r in records] == pytest.approx(due, abs=1e-6)
    assert all(lateness(r) >= 0 for r in records)  # never before its time
    for earlier, later in itertools.combinations(records, 2):
        if later["intended"] - earlier["intended"] >= APART_S and lateness(earlier) < APART_S / 2:
            assert later["sent"] - earlier["sent"] >= APART_S / 2, (earlier, later)  # never bunched
    reported = paced.lateness
    assert reported is not None and reported.count == count
    assert reported.max_s == pytest.approx(max(lateness(r) for r in records), abs=1e-3)
    assert reported.late == sum(lateness(r) > reported.tolerance_s for r in records)
    assert paced.unsent == 0
    record_property("paced_lateness_max_p99_late", (reported.max_s, reported.p99_s, reported.late))

    # 3. The whole trace due within milliseconds, one user: each request waits for the answer before it, is
    # sent late, and its latency counts that wait from its own time.
    behind, records = replay("behind", seed=103, users=1, args={"time-scale": 0.001})
    assert records[-1]["intended"] - records[0]["intended"] < 0.05
    for earlier, later in itertools.pairwise(records):
        assert later["sent"] >= earlier["intended"] + earlier["e2e"] - 0.01
        assert lateness(later) > lateness(earlier)
    assert all(r["e2e"] >= lateness(r) and r["ttft"] >= lateness(r) for r in records)
    reported = behind.lateness
    assert reported is not None and reported.late >= count - 1
    assert reported.max_s == pytest.approx(max(lateness(r) for r in records), abs=1e-3)
    assert behind.e2e.p50 is not None and reported.p50_s is not None and behind.e2e.p50 >= reported.p50_s
    record_property("behind_lateness_max_s", reported.max_s)
