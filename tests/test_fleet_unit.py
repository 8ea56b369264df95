"""The fleet benchmark's own logic, without engines (benchmarks/fleet.py, benchmarks/fleet_front.py): the
peak rate the plan is asked for, the rising load, which Prometheus answers count for a step, what the
figures must show for the proof to hold, the inputs it writes, and the front's merged metrics and stream."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import fleet
from benchmarks.fleet_front import FleetFront, labelled, merge_expositions
from kvtune import metrics
from kvtune.loadgen.runner import LoadSpec, check_server
from kvtune.profile import load_profile
from kvtune.sweep.capacity import SignalGap, Threshold, replicas_for
from kvtune.sweep.confidence import Decision, Verdict
from kvtune.sweep.spec import load_spec
from tests.helm_chart import NAMESPACE, pod_matchers
from tests.hostile_servers import Exchange, HostileServer, VllmMetrics, json_reply, text

RATES = st.floats(min_value=0.01, max_value=500, allow_nan=False, allow_infinity=False)


# ---- the rates -------------------------------------------------------------------------------------------


@given(bound=RATES)
def test_the_peak_rate_lies_between_one_bound_and_two_and_the_plan_sizes_two_replicas(bound: float) -> None:
    peak = fleet.peak_rate(bound)
    assert bound < peak < 2 * bound
    assert replicas_for(peak, bound) == 2
    assert float(f"{peak:.3g}") == peak  # as a user would type it


@given(goodput=RATES, factor=st.floats(min_value=1.01, max_value=1.99), growth=st.floats(1.05, 3.0))
def test_the_rising_load_starts_below_the_goodput_passes_through_it_and_the_peak_and_climbs(
    goodput: float, factor: float, growth: float
) -> None:
    peak = goodput * factor
    rates = fleet.ladder(goodput, peak, growth)
    assert rates[0] < goodput and rates[1] == goodput and rates[2] == peak
    assert all(low < high for low, high in itertools.pairwise(rates))
    assert len([r for r in rates if r > peak]) == fleet.MOST_STEPS_ABOVE_PEAK


@pytest.mark.parametrize(
    ("decisions", "done"),
    [
        ([(0.5, "pass"), (0.7, "pass")], False),
        ([(0.5, "pass"), (0.7, "fail")], False),  # missed, but the peak was not measured yet
        ([(0.5, "pass"), (0.7, "pass"), (1.0, "undecided")], False),  # the peak, but no decided miss
        ([(0.5, "pass"), (0.7, "fail"), (1.0, "fail")], True),
        ([(0.5, "pass"), (0.7, "pass"), (1.0, "undecided"), (1.3, "fail")], True),
    ],
)
def test_the_rising_load_stops_once_the_peak_was_measured_and_a_step_decided_to_miss(
    decisions: list[tuple[float, Decision]], done: bool
) -> None:
    assert fleet.climbed_enough(decisions, peak=1.0) is done


# ---- the answers -----------------------------------------------------------------------------------------


@given(window_s=st.floats(min_value=0, max_value=10_000, allow_nan=False))
def test_the_plan_s_window_reads_back_as_its_seconds(window_s: float) -> None:
    chosen = Threshold(
        signal="running",
        value=1.0,
        window_s=window_s,
        pass_rate=1,
        miss_rate=2,
        table=[SignalGap(signal="running")],
    )
    assert fleet.window_seconds(chosen.window) == max(1, round(window_s))


@pytest.mark.parametrize(("window", "seconds"), [("500ms", 0.5), ("2m", 120.0), ("1h", 3600.0)])
def test_other_durations_read_as_prometheus_means_them(window: str, seconds: float) -> None:
    assert fleet.window_seconds(window) == seconds


@pytest.mark.parametrize("window", ["", "s", "1.5s", "20", "20d", "-5s"])
def test_a_window_that_is_no_simple_duration_is_refused(window: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        fleet.window_seconds(window)


@settings(max_examples=60)
@given(
    times=st.lists(st.integers(0, 200), max_size=40),
    spans=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 60)), max_size=4),
    window_s=st.integers(0, 60),
)
def test_an_answer_counts_for_a_step_exactly_when_its_window_lies_inside_one_of_its_loads(
    times: list[int], spans: list[tuple[int, int]], window_s: int
) -> None:  # whole seconds: the answers come every second
    loads = [(float(start), float(start + length)) for start, length in spans]
    series = [(float(t), float(i)) for i, t in enumerate(times)]
    kept = fleet.answers_within(series, loads, window_s)
    expected = [value for t, value in series if any(s <= t - window_s and t <= e for s, e in loads)]
    assert kept == expected


@pytest.mark.parametrize(("answer", "asks"), [(0.0, 1), (2.9, 1), (3.0, 1), (3.01, 2), (9.2, 4)])
def test_keda_asks_for_the_answer_over_the_threshold_rounded_up(answer: float, asks: int) -> None:
    assert fleet.keda_replicas(answer, 3.0) == asks


# ---- what the figures must show --------------------------------------------------------------------------


def verdict(decision: Decision) -> Verdict:
    bound = {"pass": (0.5, 1.5), "fail": (2.5, 3.5), "undecided": (1.5, 2.5)}[decision]
    return Verdict(name="TTFT p90", target=2.0, samples=30, lower=bound[0], upper=bound[1], decision=decision,
                   needed=22)  # fmt: skip


def row(
    phase: fleet.Phase, replicas: int, rate: float, decision: Decision, answers: list[float]
) -> fleet.Row:
    return fleet.Row(phase=phase, replicas=replicas, rate=rate, decision=decision,
                     verdicts=[verdict(decision)], requests=30, windows=1, engine_mean=None,
                     answers=answers)  # fmt: skip


def proof(**changes: Any) -> fleet.Proof:
    """A proof that holds: g 1.0, the peak 1.5, threshold 3; the signal below it at g, above at the miss."""
    rows = [
        row("fleet", 2, 1.5, "pass", [4.0, 4.4]),
        row("single", 1, 1.0 / 1.3, "pass", [1.0, 1.2]),
        row("single", 1, 1.0, "pass", [2.0, 2.8]),
        row("single", 1, 1.5, "fail", [3.5, 5.0]),
    ]
    figures: dict[str, Any] = {
        "run": "r", "config_id": "c", "bound": 1.0, "ceiling": 1.3, "peak_rate": 1.5, "replicas": 2,
        "signal": "running", "window": "20s", "threshold": 3.0, "query": "q", "rows": rows,
    }  # fmt: skip
    return fleet.Proof(**(figures | changes))


def test_figures_that_show_every_part_of_the_proof_leave_no_problem() -> None:
    holds = proof()
    assert holds.problems() == []
    crossed = holds.crossed_at()
    assert crossed is not None and crossed.rate == 1.5
    assert "| fleet | 2 | 1.5 | **pass**" in holds.table()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"replicas": 3}, "asked for 3 replicas"),
        ({"rows": [row("fleet", 2, 1.5, "undecided", [])]}, "2 replicas at 1.5 req/s: undecided"),
        ({"rows": [row("single", 1, 1.5, "pass", [])]}, "1 replica at 1.5 req/s: pass"),
        ({"rows": [row("single", 1, 1.0, "pass", [])]}, "no Prometheus answer inside the step at g"),
        ({"rows": [row("single", 1, 1.0, "pass", [2.0, 3.0])]}, "at g the signal reached 3"),
        ({"rows": [row("single", 1, 1.0, "pass", [2.0])]}, "reached no decided miss"),
        (
            {"rows": [row("single", 1, 1.5, "fail", [2.9]), row("single", 1, 1.95, "fail", [3.1])]},
            "only at 1.95 req/s, after the first miss at 1.5",
        ),
        ({"rows": [row("single", 1, 1.5, "fail", [2.9])]}, "crossed 3 never"),
    ],
)
def test_each_part_the_figures_do_not_show_is_named(change: dict[str, Any], named: str) -> None:
    problems = proof(**change).problems()
    assert any(named in problem for problem in problems), problems


# ---- the inputs ------------------------------------------------------------------------------------------


def test_the_sweep_searches_one_config_on_core_0_validated_and_uncapped(tmp_path: Path) -> None:
    spec = load_spec(fleet.write_inputs(tmp_path))
    assert all(len(values) == 1 for values in spec.space.values() if isinstance(values, list))
    assert spec.load.rate_cap is None and spec.load.max_rate == spec.load.start_rate
    assert spec.validation.enabled and not spec.validation.base_profile and not spec.validation.vllm_defaults
    demo = yaml.safe_load(fleet.DEMO_SPEC.read_text())
    assert spec.workload.name == demo["workload"]["name"] and spec.slo.itl_p99_s == demo["slo"]["itl_p99_s"]
    assert spec.slo.ttft_p90_s == fleet.TTFT_P90_S
    base = load_profile(tmp_path / "base.yaml")
    assert base.cpu_threads_bind == "0" and base.cpu_reserved_cores is None
    assert base.kv_cache_dtype == "auto" and base.enforce_eager


# ---- the front -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            'vllm:num_requests_running{engine="0"} 3.0',
            'vllm:num_requests_running{replica="1",engine="0"} 3.0',
        ),
        ("vllm:num_requests_running 3.0", 'vllm:num_requests_running{replica="1"} 3.0'),
        ("up 1 1700000000", 'up{replica="1"} 1 1700000000'),
    ],
)
def test_a_sample_line_gets_its_replica_label(line: str, expected: str) -> None:
    assert labelled(line, 1) == expected


@given(
    running=st.lists(st.integers(0, 64), min_size=1, max_size=4),
    usage=st.lists(st.floats(0, 1, allow_nan=False), min_size=4, max_size=4),
)
def test_merged_engines_metrics_read_as_one_exposition_holding_each_engine_s_numbers(
    running: list[int], usage: list[float]
) -> None:
    texts = [
        VllmMetrics(running=str(r), kv_usage=repr(u)).text() for r, u in zip(running, usage, strict=False)
    ]
    exposition = metrics.read_exposition(merge_expositions(texts))
    assert not exposition.skipped
    assert metrics.total(exposition.samples, metrics.REQUESTS_RUNNING) == sum(running)
    by_replica = {
        s.labels["replica"]: s.value for s in exposition.samples if s.name == metrics.KV_CACHE_USAGE
    }
    assert by_replica == {str(i): u for i, u in enumerate(usage[: len(running)])}
    merged = merge_expositions(texts)
    assert merged.count(f"# TYPE {metrics.REQUESTS_RUNNING} ") == 1


def _stream(exchange: Exchange) -> None:
    exchange.start(200, {"content-type": "text/event-stream"})
    for token in ("data: one\n\n", "data: two\n\n", "data: [DONE]\n\n"):
        exchange.write(token.encode())
    exchange.finish()


def test_the_front_passes_the_router_s_api_through_and_serves_the_engines_metrics_as_the_runner_needs() -> (
    None
):
    with HostileServer() as router, HostileServer() as first, HostileServer() as second:
        router.route("/v1/models", json_reply({"object": "list", "data": [{"id": "m", "object": "model"}]}))
        router.route("/v1/chat/completions", _stream)
        first.route("/metrics", text(VllmMetrics(running="2").text()))
        second.route("/metrics", text(VllmMetrics(running="5").text()))
        with FleetFront(router.url, [first.url, second.url]) as front, httpx.Client(timeout=10) as client:
            check_server(LoadSpec(url=front.url, model="m"), client)  # the load runner takes it as an engine
            samples = metrics.scrape(front.url, client)
            assert metrics.total(samples, metrics.REQUESTS_RUNNING) == 7
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            with client.stream("POST", f"{front.url}/v1/chat/completions", json=body) as answer:
                assert answer.headers["content-type"] == "text/event-stream"
                assert answer.read().decode().endswith("data: [DONE]\n\n")
            forwarded = [r for r in router.requests if r.path == "/v1/chat/completions"]
            assert len(forwarded) == 1 and b'"hi"' in forwarded[0].body
        assert router.count("/metrics") == 0  # the engines' numbers, not the router's own


def test_the_pods_prometheus_scrapes_are_the_ones_the_chart_s_matchers_select() -> None:
    namespace, pod_pattern = pod_matchers(fleet.FULLNAME).split(",", 1)
    assert namespace == f'namespace="{NAMESPACE}"'
    pattern = pod_pattern.removeprefix('pod=~"').removesuffix('"')
    for index in range(4):
        target = fleet.PodTarget("e", "127.0.0.1", 1, pod=fleet.pod_name(index))
        assert target.labels["namespace"] == NAMESPACE
        assert re.fullmatch(pattern, target.labels["pod"]), target.labels


def test_a_proof_that_cannot_go_on_ends_in_one_line_and_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def stopped(_folder: Path, _log: fleet.Log) -> fleet.Proof:
        raise fleet.ProofStopped("the winner failed validation on held-out load")

    monkeypatch.setattr(fleet, "run_proof", stopped)
    assert fleet.main(["--folder", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "not shown: the winner failed validation on held-out load" in out and "Traceback" not in out
