"""The trace workload without Locust or an engine: its pacing, its requests, its flags and the run's report.

A hash-block trace becomes token-id prompts whose ids are equal exactly where the trace's block ids are,
answered at the trace's output lengths (ignore_eos) and cut to the engine's max_model_len with the cut
reported; a text trace keeps its messages and its timestamps; each request is due at the trace's own
(scaled) time, and a run that sends it later reports by how much.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from kvtune.commands.load import lateness_text, result_notes
from kvtune.loadgen.pacing import ArrivalSchedule, schedule_for
from kvtune.loadgen.results import LATE_TOLERANCE_S, EngineDeltas, merge_results
from kvtune.loadgen.runner import LoadSpec, _unsent, summarize
from kvtune.loadgen.trace_workload import (
    EngineFacts,
    TraceArgs,
    TraceWorkload,
    build_trace_workload,
    trace_arrivals,
)
from kvtune.loadgen.workload_args import WorkloadError, validate_workload_args
from kvtune.loadgen.workloads import Conversation, LLMRequest
from kvtune.sweep.spec import load_spec
from kvtune.traces.format import TraceRequest, write_trace
from kvtune.traces.synthetic import ChatTraceShape, chat_trace
from tests.helpers import DEFAULT_PROFILE

ENGINE = EngineFacts(block_size=16, max_model_len=4096, vocab_size=49152)


def write_blocks(path: Path, requests: list[TraceRequest], block_size: int | None = 32) -> Path:
    with path.open("w") as file:
        write_trace(file, requests, block_size)
    return path


def write_lines(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def workload(
    path: Path, engine: EngineFacts = ENGINE, flags: dict[str, str | int | float] | None = None
) -> TraceWorkload:
    args = TraceArgs.of({"trace-file": str(path), **(flags or {})})
    return build_trace_workload(args, engine, "trace", default_max_tokens=64)


def requests_of(built: TraceWorkload) -> list[LLMRequest]:
    return [built.next_request(i, Conversation()) for i in range(len(built))]


# Three requests of 32-token trace blocks: the second shares the first's first block, the third none.
SHARING = [
    TraceRequest(0.0, 64, 10, (1, 2)),
    TraceRequest(1500.0, 96, 20, (1, 3, 4)),
    TraceRequest(4000.0, 40, 4, (5, 6)),
]


# ---- pacing ------------------------------------------------------------------------------------------------


def test_a_trace_schedule_is_the_traces_own_times_from_the_first_claim_and_ends_with_it() -> None:
    schedule = ArrivalSchedule(kind="trace", offsets=[0.0, 1.5, 1.5, 4.0], start=100.0)
    assert [schedule.next_slot() for _ in range(4)] == [(0, 100.0), (1, 101.5), (2, 101.5), (3, 104.0)]
    assert schedule.ended(4) and not schedule.ended(3)
    with pytest.raises(IndexError):
        schedule.time_of(4)
    assert list(schedule.times_before(104.0)) == [100.0, 101.5, 101.5]
    schedule.reset()  # a new run (Locust's web UI) starts the same times on a new clock
    index = schedule.next_index()
    assert index == 0 and schedule.start > 100.0
    for bad in ([1.0, 0.5], [-1.0], [float("nan")]):
        with pytest.raises(ValueError, match="in order"):
            ArrivalSchedule(kind="trace", offsets=bad)


def test_a_runs_schedule_is_chosen_by_its_arrival() -> None:
    assert schedule_for("closed", None, offsets=[0.0, 1.0]) is None
    paced = schedule_for("trace", None, offsets=[0.0, 2.0])
    assert paced is not None and paced.limit == 2
    # At a rate, a trace keeps its order and its end: no more slots than it has requests.
    rated = schedule_for("constant", 4.0, offsets=[0.0, 9.0, 9.5])
    assert rated is not None and rated.limit == 3
    rated.start = 10.0
    assert list(rated.times_before(99.0)) == [10.0, 10.25, 10.5]
    unbounded = schedule_for("poisson", 2.0, seed=1)
    assert unbounded is not None and unbounded.limit is None
    with pytest.raises(ValueError, match="has none"):
        schedule_for("trace", None)
    with pytest.raises(ValueError, match="needs a rate"):
        schedule_for("constant", None)


def test_arrivals_come_from_the_trace_window_and_time_scale(tmp_path: Path) -> None:
    path = write_blocks(tmp_path / "t.jsonl", SHARING)
    assert trace_arrivals(TraceArgs.of({"trace-file": str(path)}), "trace", 64) == [0.0, 1.5, 4.0]
    faster = TraceArgs.of({"trace-file": str(path), "time-scale": 0.5, "trace-start": 1})
    assert trace_arrivals(faster, "trace", 64) == [0.0, 1.25]
    first_two = TraceArgs.of({"trace-file": str(path), "trace-duration": 2})
    assert trace_arrivals(first_two, "trace", 64) == [0.0, 1.5]


# ---- a hash-block trace's requests -------------------------------------------------------------------------


def test_equal_hash_ids_give_equal_token_ids_and_different_ids_different_ones(tmp_path: Path) -> None:
    built = workload(write_blocks(tmp_path / "t.jsonl", SHARING))
    first, second, third = requests_of(built)
    # The engine's block is 16 tokens and, by default, a trace block becomes one engine block.
    ids = [r.prompt_token_ids or [] for r in (first, second, third)]
    assert [len(i) for i in ids] == [32, 48, 20]  # 64, 96 and 40 trace tokens at half scale
    assert ids[0][:16] == ids[1][:16]  # hash id 1: the same block
    assert ids[0][16:32] != ids[1][16:32]  # hash ids 2 and 3
    assert ids[2][:16] not in (ids[0][:16], ids[0][16:32], ids[1][16:32])  # id 5: shared with nothing
    assert [r.trace_index for r in (first, second, third)] == [0, 1, 2]
    assert all(r.messages is None and r.prompt is None for r in (first, second, third))
    # Answers have the trace's lengths (scaled as the prompts are), whatever the model would say.
    assert [r.max_tokens for r in (first, second, third)] == [5, 10, 2]
    assert all(r.ignore_eos for r in (first, second, third))
    # The designed reuse: the second request's first block was in the first request's prompt.
    assert [r.shared_tokens for r in (first, second, third)] == [0, 16, 0]
    assert built.target_reuse == pytest.approx(16 / (32 + 48 + 20))
    # The same trace and seed give the same ids in every process; another seed others.
    again = requests_of(workload(tmp_path / "t.jsonl"))
    assert [r.prompt_token_ids for r in again] == ids
    other = build_trace_workload(TraceArgs.of({"trace-file": str(tmp_path / "t.jsonl")}, 7), ENGINE, "trace",
                                 64, seed=7)  # fmt: skip
    assert other.next_request(0, Conversation()).prompt_token_ids != ids[0]


def test_tokens_per_block_and_output_scale_set_the_sizes(tmp_path: Path) -> None:
    path = write_blocks(tmp_path / "t.jsonl", SHARING)
    first = requests_of(workload(path, flags={"tokens-per-block": 32, "output-scale": 2}))[0]
    assert first.prompt_tokens == 64 and first.max_tokens == 20
    assert first.prompt_token_ids is not None and len(first.prompt_token_ids) == 64
    # Token ids stay below the served model's vocabulary.
    small = EngineFacts(block_size=16, max_model_len=4096, vocab_size=1200)
    assert max(requests_of(workload(path, small))[1].prompt_token_ids or []) < 1200


def test_lengths_are_cut_to_max_model_len_and_the_cut_is_counted(tmp_path: Path) -> None:
    path = write_blocks(tmp_path / "t.jsonl", SHARING)
    built = workload(path, EngineFacts(block_size=16, max_model_len=40, vocab_size=None))
    first, second, third = requests_of(built)
    assert all(r.prompt_tokens + r.max_tokens <= 40 for r in (first, second, third))
    assert (first.cut_prompt_tokens, second.cut_prompt_tokens, third.cut_prompt_tokens) == (0, 18, 0)
    assert (built.cuts.requests, built.cuts.prompt_tokens, built.cuts.output_tokens) == (1, 18, 0)
    assert built.describe()["cut_requests"] == 1
    assert second.prompt_token_ids is not None and len(second.prompt_token_ids) == second.prompt_tokens == 30


def test_synthetic_chat_trace_turns_reuse_their_conversation(tmp_path: Path) -> None:
    shape = ChatTraceShape(conversations=6, system_prompts=2, turns=3, block_size=16, think_s=2.0)
    path = write_blocks(tmp_path / "chat.jsonl", chat_trace(shape), 16)
    built = workload(path, flags={"trace-sample": 0.5})
    assert 0 < len(built) < len(chat_trace(shape))  # whole conversations kept
    assert built.target_reuse is not None and built.target_reuse > 0.5  # system prompts and histories


# ---- a text trace ------------------------------------------------------------------------------------------

CHAT = [
    {"timestamp": 0, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]},
    {"timestamp": 400, "prompt": "Once upon", "max_tokens": 3},
    {"timestamp": 1000, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
                                     {"role": "assistant", "content": "x"},
                                     {"role": "user", "content": "b"}]},
]  # fmt: skip


def test_a_text_trace_keeps_its_messages_and_its_timestamps(tmp_path: Path) -> None:
    built = workload(write_lines(tmp_path / "chat.jsonl", CHAT), flags={"time-scale": 2})
    assert built.arrivals == [0.0, 0.8, 2.0]
    first, second, third = requests_of(built)
    assert first.messages == CHAT[0]["messages"] and first.max_tokens == 64
    assert second.prompt == "Once upon" and second.max_tokens == 3
    assert third.messages == CHAT[2]["messages"] and third.trace_index == 2
    assert not any(r.ignore_eos or r.prompt_token_ids for r in (first, second, third))
    # Whole conversations: the third turn resends the first, so a sample keeps or drops both together.
    for seed in range(8):
        kept = [r.trace_index for r in requests_of(build_trace_workload(
            TraceArgs.of({"trace-file": str(tmp_path / "chat.jsonl"), "trace-sample": 0.5}, seed), ENGINE,
            "trace", 64, seed))]  # fmt: skip
        assert (0 in kept) == (2 in kept), kept


def test_a_text_trace_without_timestamps_replays_closed_but_not_at_its_own_times(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    args = TraceArgs.of({"trace-file": str(path)})
    assert trace_arrivals(args, "closed", 64) == [0.0, 0.0]
    with pytest.raises(WorkloadError, match="no line has a timestamp, so there are no arrival times to keep"):
        trace_arrivals(args, "trace", 64)


BAD_TEXT: list[tuple[list[dict[str, Any]], str]] = [
    ([{"timestamp": 0, "prompt": "a"}, {"prompt": "b"}],
     "x.jsonl:2: has no timestamp, unlike line 1; give every line a timestamp (ms) or none"),
    ([{"timestamp": 5, "prompt": "a"}, {"timestamp": 4, "prompt": "b"}],
     "x.jsonl:2: timestamp 4 ms is before the previous line's 5 ms"),
    ([{"timestamp": "soon", "prompt": "a"}], "x.jsonl:1: timestamp is not a number of milliseconds"),
    ([{"timestamp": 0, "text": "a"}],
     "x.jsonl:1: expected an object with exactly one of 'messages' or 'prompt'"),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "message"), BAD_TEXT)
def test_a_bad_text_trace_names_the_line(tmp_path: Path, lines: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(WorkloadError) as error:
        workload(write_lines(tmp_path / "x.jsonl", lines))
    assert message in str(error.value)


# ---- flags -------------------------------------------------------------------------------------------------

BAD_FLAGS: list[tuple[dict[str, str | int | float], str]] = [
    ({}, "trace-file: the trace workload needs a JSONL trace"),
    ({"trace-file": "/nonexistent/t.jsonl"},
     "trace-file: /nonexistent/t.jsonl does not exist or is not a file"),
    ({"time-scale": 0}, "time-scale: 0.0 must be above 0, e.g. time-scale=0.5"),
    ({"time-scale": "fast"}, "time-scale: 'fast' is not a number"),
    ({"trace-sample": 1.5}, "trace-sample: 1.5 is outside 0..1"),
    ({"trace-sample": 0}, "trace-sample: 0.0 must be above 0"),
    ({"trace-count": 0}, "trace-count: 0 is below 1"),
    ({"trace-start": -1}, "trace-start: -1 is below 0"),
    ({"trace-duration": -5}, "trace-duration: -5.0 must be above 0"),
    ({"tokens-per-block": "abc"}, "tokens-per-block: 'abc' is not an integer"),
    ({"trace-block-size": 0}, "trace-block-size: 0 is below 1"),
    ({"output-scale": float("inf")}, "output-scale: inf is not a finite number"),
    ({"time-scal": 2}, "time-scal: not a flag of the trace workload; did you mean 'time-scale'?"),
    ({"max-tokens": 8}, "max-tokens: a load setting, not a flag of the trace workload"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "message"), BAD_FLAGS)
def test_bad_flags_are_refused_naming_the_flag(
    tmp_path: Path, flags: dict[str, str | int | float], message: str
) -> None:
    given: dict[str, str | int | float] = {"trace-file": str(write_blocks(tmp_path / "t.jsonl", SHARING))}
    args = flags if not flags or "trace-file" in flags else given | flags
    with pytest.raises(WorkloadError) as error:
        validate_workload_args("trace", args)
    assert str(error.value).startswith(message), str(error.value)


ENGINE_MISFITS: list[tuple[dict[str, str | int | float], EngineFacts, str]] = [
    ({"tokens-per-block": 24}, ENGINE,
     "tokens-per-block: tokens per trace block 24 is not a multiple of the engine's block size 16"),
    ({}, EngineFacts(block_size=None),
     "tokens-per-block: the engine reports no block size (vllm:cache_config_info on its /metrics)"),
    ({"trace-block-size": 64}, ENGINE,
     "block_size 32 disagrees with --trace-block-size 64"),
    ({"trace-start": 3}, ENGINE, "trace-start: trace start 3 is past the trace's 3 requests"),
    ({}, EngineFacts(block_size=16, vocab_size=900), "a vocabulary of 900 tokens is too small"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "engine", "message"), ENGINE_MISFITS)
def test_a_trace_that_does_not_fit_the_engine_is_refused_with_the_fix(
    tmp_path: Path, flags: dict[str, str | int | float], engine: EngineFacts, message: str
) -> None:
    with pytest.raises(WorkloadError) as error:
        workload(write_blocks(tmp_path / "t.jsonl", SHARING), engine, flags)
    assert message in str(error.value), str(error.value)


def test_block_flags_on_a_text_trace_are_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match=r"^output-scale: .* is a text trace .* applies to hash-block"):
        workload(write_lines(tmp_path / "chat.jsonl", CHAT), flags={"output-scale": 1})


# ---- the load spec and the run's report --------------------------------------------------------------------


def test_a_trace_arrives_at_its_own_times_runs_to_its_end_and_is_measured_whole(tmp_path: Path) -> None:
    path = str(write_blocks(tmp_path / "t.jsonl", SHARING))
    spec = LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path})
    assert (spec.arrival, spec.duration_s, spec.warmup_s, spec.run_seconds) == ("trace", None, 0.0, None)
    argv = spec.locust_args(tmp_path / "samples.jsonl")
    assert argv[argv.index("--run-for") + 1] == "0" and argv[argv.index("--arrival") + 1] == "trace"
    assert "--arrival-rate" not in argv
    # What a user or a sweep sets is kept: a closed loop, a rate, a window, a warm-up.
    swept = LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path},
                     arrival="poisson", rate=2.0, duration_s=20, warmup_s=2)  # fmt: skip
    assert (swept.arrival, swept.run_seconds) == ("poisson", 22)
    closed = LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path},
                      arrival="closed")  # fmt: skip
    argv = closed.locust_args(tmp_path / "samples.jsonl")
    assert argv[argv.index("--arrival") + 1] == "closed"
    # Other workloads keep theirs.
    other = LoadSpec(url="http://127.0.0.1:1", duration_s=None, warmup_s=None)
    assert (other.arrival, other.duration_s, other.warmup_s) == ("closed", 30.0, 5.0)


def test_a_trace_pacing_without_a_trace_and_a_split_trace_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="arrival: 'trace' keeps a trace's own arrival times"):
        LoadSpec(url="http://127.0.0.1:1", arrival="trace")
    path = str(write_blocks(tmp_path / "t.jsonl", SHARING))
    with pytest.raises(ValidationError, match="workers: 2, but a trace is one sequence of requests"):
        LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path}, workers=2)


def record(intended: float, sent: float, e2e: float = 0.5, **extra: Any) -> dict[str, Any]:
    return {"intended": intended, "sent": sent, "ttft": 0.1, "e2e": e2e, "itl": [], "completion_tokens": 4,
            "designed_prompt_tokens": 32, "designed_shared_tokens": 16, "error": None,
            "_source": "samples.1.jsonl"} | extra  # fmt: skip


def test_lateness_is_reported_from_the_samples_and_shown(tmp_path: Path) -> None:
    path = str(write_blocks(tmp_path / "t.jsonl", SHARING))
    spec = LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path})
    arrivals = [0.0, 1.5, 4.0]
    on_time, late = LATE_TOLERANCE_S / 2, 0.75
    records = [
        record(100.0, 100.0 + on_time),
        record(101.5, 101.5 + late, e2e=1.0, cut_prompt_tokens=18),
        record(104.0, 104.0, cut_output_tokens=2, cut_prompt_tokens=0),
    ]
    result = summarize(spec, records, 100.0, 104.6, EngineDeltas(), arrivals)
    assert result.lateness is not None
    assert (result.lateness.count, result.lateness.late) == (3, 1)
    assert result.lateness.max_s == pytest.approx(late)
    assert result.samples is not None and result.samples.lateness == sorted(
        round(r["sent"] - r["intended"], 4) for r in records
    )
    assert result.unsent == 0 and result.intended_rate is None
    assert result.trace_cuts is not None
    assert (result.trace_cuts.requests, result.trace_cuts.prompt_tokens, result.trace_cuts.output_tokens) == (
        2, 18, 2,
    )  # fmt: skip
    assert "sent late: 1 of 3 beyond 50 ms" in lateness_text(result) and "max 750 ms" in lateness_text(result)
    assert any(
        "2 trace requests were cut to fit the engine's max_model_len" in n for n in result_notes(result)
    )
    # Two windows merged keep every sample's lateness.
    merged = merge_results(result, result).lateness
    assert merged is not None and (merged.count, merged.late) == (6, 2)
    assert merged.max_s == pytest.approx(late)
    # A closed loop sends each request when its user is free: no lateness to report.
    closed = LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path},
                      arrival="closed")  # fmt: skip
    assert summarize(closed, records, 100.0, 104.6, EngineDeltas(), arrivals).lateness is None


def test_requests_of_a_trace_never_sent_are_counted_unsent(tmp_path: Path) -> None:
    path = str(write_blocks(tmp_path / "t.jsonl", SHARING))
    spec = LoadSpec(url="http://127.0.0.1:1", workload="trace", workload_args={"trace-file": path},
                    duration_s=5)  # fmt: skip
    arrivals = [0.0, 1.5, 4.0]
    sent = [record(100.0, 100.0), record(101.5, 103.9)]  # the run ended before the third was sent
    assert _unsent(spec, sent, 100.0, 105.0, arrivals) == 1
    assert _unsent(spec, sent, 100.0, 103.0, arrivals) == 0  # the third was not due in that window


# ---- sweeps ------------------------------------------------------------------------------------------------


def test_a_sweep_spec_searches_and_validates_on_a_trace(tmp_path: Path) -> None:
    write_blocks(tmp_path / "t.jsonl", SHARING)
    spec = yaml.safe_load((DEFAULT_PROFILE.parent.parent / "sweeps" / "cpu-quick.yaml").read_text())
    spec["base_profile"] = str(DEFAULT_PROFILE)
    spec["workload"] = {"name": "trace", "args": {"trace-file": "t.jsonl", "time-scale": 0.5}, "users": 4}
    spec["validation"]["workload"] = {"name": "trace", "args": {"trace-file": "t.jsonl", "trace-sample": 0.5}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    loaded = load_spec(tmp_path / "sweep.yaml")
    assert loaded.workload.args == {"trace-file": str(tmp_path / "t.jsonl"), "time-scale": 0.5}
    assert loaded.validation.workload is not None
    assert loaded.validation.workload.args["trace-file"] == str(tmp_path / "t.jsonl")
    # A trial's load step, as kvtune.sweep.trial builds it: the trace in its order at the step's rate.
    searched = loaded.workload
    step = LoadSpec(url="http://127.0.0.1:1", workload=searched.name, workload_args=searched.args, users=4,
                    arrival=loaded.load.arrival, rate=1.25, duration_s=22, warmup_s=2)  # fmt: skip
    assert step.arrival == "poisson" and step.run_seconds == 24
    spec["workload"]["args"] = {"trace-file": "t.jsonl", "time-scal": 0.5}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(Exception, match="did you mean 'time-scale'"):
        load_spec(tmp_path / "sweep.yaml")
