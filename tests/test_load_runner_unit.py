"""The load runner without Locust or an engine: open-loop accounting, where the API key goes, which files,
and what the engine's histograms say over a window."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr, ValidationError

from kvtune import metrics, metrics_window
from kvtune.loadgen import locustfiles
from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.loadgen.results import EngineDeltas, engine_deltas, merge_engine_deltas
from kvtune.loadgen.runner import LOCUST_HOST_ENV, LoadSpec, _locust_argv, _unsent
from kvtune.loadgen.workload_args import API_KEY_ENV
from kvtune.metrics_window import Peaks
from tests.hostile_servers import POOL_LABELS, VllmMetrics


def sent(schedule: ArrivalSchedule, count: int, source: str = "samples.1.jsonl") -> list[dict[str, Any]]:
    return [{"intended": schedule.time_of(i), "_source": source} for i in range(count)]


def test_poisson_slots_are_counted_from_the_schedule_not_rate_times_duration() -> None:
    spec = LoadSpec(url="http://127.0.0.1:1", arrival="poisson", rate=0.15, seed=3)
    schedule = ArrivalSchedule(0.15, "poisson", start=1000.0, seed=3)
    start, end = 1003.0, 1023.0
    due = [i for i in range(50) if start <= schedule.time_of(i) < end]
    last = max(i for i in range(50) if schedule.time_of(i) < end)
    everything = sent(schedule, last + 1)
    # Every due slot was sent: none unsent, whatever 0.15 x 20 s rounds to.
    assert _unsent(spec, everything, start, end) == 0
    # The run ended before the last due slot was sent: exactly that one is unsent.
    assert due, "the seeded schedule should put requests in the window"
    assert _unsent(spec, everything[: due[-1]], start, end) == 1


def test_closed_loop_never_has_unsent_requests() -> None:
    spec = LoadSpec(url="http://127.0.0.1:1", arrival="closed")
    assert _unsent(spec, [], 0.0, 10.0) == 0


def test_the_api_key_and_the_url_reach_locust_through_its_environment_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "inherited-key")
    url = "http://user:pa55word@127.0.0.1:1"
    spec = LoadSpec(url=url, api_key=SecretStr("s3cret-key"))
    argv = _locust_argv(spec) + spec.locust_args(Path("/tmp/samples.jsonl"))
    assert not any("s3cret" in word or "pa55word" in word or "127.0.0.1" in word for word in argv)
    assert spec.locust_env()[API_KEY_ENV] == "s3cret-key"
    assert spec.locust_env()[LOCUST_HOST_ENV] == url
    assert "s3cret" not in spec.model_dump_json() and "s3cret" not in repr(spec)
    assert "api_key" not in spec.model_dump()
    # No key in the spec: none inherited either, so the spec alone says what Locust sends.
    assert API_KEY_ENV not in LoadSpec(url="http://127.0.0.1:1").locust_env()
    assert spec.auth_headers() == {"Authorization": "Bearer s3cret-key"}


def test_locust_runs_the_packaged_files_not_a_checkout() -> None:
    argv = _locust_argv(LoadSpec(url="http://127.0.0.1:1", workload="multi_turn"))
    locustfile = Path(argv[argv.index("-f") + 1])
    assert locustfile == Path(locustfiles.__file__).parent / "multi_turn.py" and locustfile.is_file()


def test_workload_args_are_checked_by_the_spec() -> None:
    spec = LoadSpec(url="http://127.0.0.1:1", workload_args={"system-tokens": "96"})
    assert spec.workload_args == {"system-tokens": 96}
    with pytest.raises(ValidationError, match="workload_args: sytem-tokens: not a flag of the shared_prefix"):
        LoadSpec(url="http://127.0.0.1:1", workload_args={"sytem-tokens": 96})


def _iteration_histogram(buckets: dict[str, float], count: float, total: float) -> str:
    lines = [
        f'vllm:iteration_tokens_total_bucket{{le="{le}",model_name="m"}} {n}' for le, n in buckets.items()
    ]
    lines += [f'vllm:iteration_tokens_total_count{{model_name="m"}} {count}']
    lines += [f'vllm:iteration_tokens_total_sum{{model_name="m"}} {total}']
    return "\n".join(lines) + "\n"


def test_engine_steps_over_a_window_come_from_the_iteration_tokens_histogram() -> None:
    # Before the window: 10 steps of at most 8 tokens. In it: 4 more steps, the largest in (256, 512].
    before = metrics.parse(
        _iteration_histogram({"8.0": 10, "256.0": 10, "512.0": 10, "2048.0": 10, "+Inf": 10}, 10, 40)
    )
    after = metrics.parse(
        _iteration_histogram({"8.0": 12, "256.0": 13, "512.0": 14, "2048.0": 14, "+Inf": 14}, 14, 740)
    )
    deltas = engine_deltas(before, after, Peaks())
    assert deltas.largest_step_tokens == 512.0
    assert deltas.mean_step_tokens == 175.0  # (740 - 40) / 4
    # A window without steps, or with a step above the last finite edge, claims no largest step.
    assert engine_deltas(after, after, Peaks()).largest_step_tokens is None
    beyond = metrics.parse(
        _iteration_histogram({"8.0": 12, "256.0": 13, "512.0": 14, "2048.0": 14, "+Inf": 15}, 15, 5000)
    )
    assert engine_deltas(before, beyond, Peaks()).largest_step_tokens is None
    # A label that is no number is skipped, not a traceback.
    odd = metrics.parse(_iteration_histogram({"abc": 1, "512.0": 14, "+Inf": 14}, 14, 740))
    assert engine_deltas(before, odd, Peaks()).largest_step_tokens == 512.0


def test_merged_windows_keep_the_largest_step() -> None:
    first = EngineDeltas(largest_step_tokens=128.0, mean_step_tokens=60.0)
    later = EngineDeltas(largest_step_tokens=512.0, mean_step_tokens=100.0)
    merged = merge_engine_deltas(first, later, 10, 30)
    assert merged.largest_step_tokens == 512.0
    assert merged.mean_step_tokens == 90.0
    assert merge_engine_deltas(first, EngineDeltas(), 10, 30).largest_step_tokens == 128.0


def test_an_engine_restarted_in_the_window_gives_deltas_from_the_restart_not_below_zero() -> None:
    before = metrics.parse(VllmMetrics(hits="100", queries="1000", prompt_tokens="1000").text())
    after = metrics.parse(VllmMetrics(hits="90", queries="110", prompt_tokens="10").text())
    deltas = engine_deltas(before, after, Peaks())
    assert deltas.counters_reset
    assert (deltas.prefix_cache_hits, deltas.prefix_cache_queries, deltas.prompt_tokens) == (90, 110, 10)
    assert deltas.hit_rate == pytest.approx(90 / 110)  # not (90 - 100) / (110 - 1000)
    steady = engine_deltas(before, before, Peaks())
    assert not steady.counters_reset and steady.prefix_cache_hits == 0
    assert merge_engine_deltas(steady, deltas, 1, 1).counters_reset


def test_pool_labels_that_are_no_numbers_leave_the_capacity_unknown_not_a_traceback() -> None:
    samples = metrics.parse(VllmMetrics(pool=POOL_LABELS | {"num_gpu_blocks": "inf"}).text())
    assert engine_deltas(samples, samples, Peaks()).kv_capacity is None


def test_gauge_means_are_the_mean_of_the_looks_and_merge_by_window_length() -> None:
    peaks = Peaks()
    assert EngineDeltas.of(metrics_window.WindowFacts(seconds=1.0), None).mean_waiting is None
    for running, waiting in ((2, 0), (4, 3), (6, 9)):
        peaks.update(metrics.parse(VllmMetrics(running=str(running), waiting=str(waiting)).text()))
    deltas = EngineDeltas.of(metrics_window.WindowFacts(seconds=3.0, peaks=peaks), None)
    assert (deltas.mean_running, deltas.mean_waiting) == (4.0, 4.0)
    assert (deltas.peak_running, deltas.peak_waiting) == (6.0, 9.0)
    # Means weigh each window by its length, not by its requests: 10 s at 4 and 30 s at 8 is 7.
    merged = merge_engine_deltas(deltas, EngineDeltas(mean_running=8.0), 100, 1, (10.0, 30.0))
    assert merged.mean_running == 7.0
    assert merged.mean_waiting == 4.0  # the later window knew none: the one known figure stands
