"""A trace workload's curve in the sweep: pools that cannot hold the trace pruned with the arithmetic, larger
pools the curve puts within curve_noise of a smaller one not measured, and the report's curve plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvtune.sweep.prune import candidates
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.trace_curve import TraceCurves, usable_blocks, within_noise, write_curve_plot
from kvtune.traces.format import write_trace
from kvtune.traces.synthetic import ChatTraceShape, chat_trace
from tests.helpers import write_test_profile

pytestmark = pytest.mark.usefixtures("fake_host")  # an AVX-512 host: the profile's fp8 KV is kept


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    shape = ChatTraceShape(
        conversations=40, block_size=128, system_tokens=256, user_tokens=96, output_tokens=16
    )
    with path.open("w") as file:
        write_trace(file, chat_trace(shape), 128)
    return path


def trace_spec(trace: Path, pools: list[int], **more: Any) -> SweepSpec:
    base = write_test_profile(trace.parent / "base.yaml", max_model_len=768)
    return SweepSpec.model_validate(
        {
            "name": "t",
            "base_profile": str(base),
            "space": {"num_gpu_blocks_override": pools, "max_num_batched_tokens": [128, 512]},
            "workload": {"name": "trace", "args": {"trace-file": str(trace)}, "users": 2},
            "slo": {"ttft_p99_s": 2.0},
        }
        | more
    )


def test_within_noise_keeps_a_pool_only_when_it_beats_the_last_kept_one() -> None:
    skipped = within_noise([(10, 0.30), (20, 0.50), (21, 0.505), (22, 0.509), (40, 0.52), (80, 0.60)], 0.01)
    assert skipped == {21: (20, 0.50, 0.505), 22: (20, 0.50, 0.509)}  # 40 is 0.02 above 20: kept


def test_the_sweep_prunes_pools_by_the_trace_s_curve(trace_file: Path) -> None:
    spec = trace_spec(trace_file, [8, 12, 13, 60, 61, 62])
    curves = TraceCurves.of(spec)
    assert curves is not None
    rate = curves.for_profile(spec.base()).curve.hit_rate
    by_pool: dict[int, list[str | None]] = {}
    for candidate in candidates(spec, spec.base(), spec.grid()):
        assert candidate.profile is not None
        pool = usable_blocks(candidate.profile)
        assert pool is not None
        by_pool.setdefault(pool, []).append(candidate.pruned)
    # Each pool twice, once per max_num_batched_tokens value: each value is a group of its own.
    assert sorted(by_pool) == [7, 11, 12, 59, 60, 61] and all(len(r) == 2 for r in by_pool.values())
    # Two users of the trace's mean request (about 4 blocks of 128) do not fit seven blocks.
    assert all(r is not None and "2 requests running hold 8 (2 x 4.0" in r for r in by_pool[7]), by_pool[7]
    # 12 blocks predict more than a point above 11: both measured; so is 59, far above.
    assert rate(12) - rate(11) >= 0.01
    assert by_pool[11] == by_pool[12] == by_pool[59] == [None, None]
    # 60 and 61 predict within a point of 59: measured as 59.
    assert rate(61) - rate(59) < 0.01
    for pool in (60, 61):
        for reason in by_pool[pool]:
            assert reason is not None and f"{rate(pool):.1%} at {pool:,} usable blocks" in reason
            assert "at 59: within curve_noise 0.01 of the smaller pool" in reason


def test_curve_noise_0_measures_every_pool(trace_file: Path) -> None:
    spec = trace_spec(trace_file, [12, 13, 60, 61], curve_noise=0)
    assert all(candidate.pruned is None for candidate in candidates(spec, spec.base(), spec.grid()))


def test_the_report_draws_the_curve_with_measured_points(trace_file: Path, tmp_path: Path) -> None:
    spec = trace_spec(trace_file, [12, 60])
    path = write_curve_plot(tmp_path, spec, [(13 * 128, 0.4, "a"), (None, 0.5, "b"), (61 * 128, 0.6, "c")])
    assert path is not None
    svg = path.read_text()
    assert "measured by the engine" in svg and "predicted (one at a time)" in svg
