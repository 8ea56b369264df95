"""Traces read strictly, windowed by whole conversations, and turned into engine token ids; bad traces are
refused naming the line, the field and the fix, in bounded time and memory."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvtune.traces.format import (
    MAX_LINE_BYTES,
    Trace,
    TraceError,
    TraceRequest,
    read_trace,
    trace_line,
    write_trace,
)
from kvtune.traces.synthetic import ChatTraceShape, chat_trace
from kvtune.traces.tokens import TOKEN_HIGH, TOKEN_LOW, BlockMapping, engine_request, prompt_token_ids
from kvtune.traces.window import TraceWindow, conversations, select


def line(
    timestamp: Any = 0, input_length: Any = 10, output_length: Any = 5, hash_ids: Any = None, **more: Any
) -> str:
    item = {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": [0] if hash_ids is None else hash_ids,
    } | more
    return json.dumps(item)


def write_lines(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(f"{text}\n" for text in lines))
    return path


def refusal(path: Path, block_size: int | None = None) -> str:
    with pytest.raises(TraceError) as info:
        read_trace(path, block_size)
    message = str(info.value)
    assert message.startswith(f"{path}"), message
    return message


def test_a_mooncake_line_reads_with_its_default_block_size(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        line(0, 1000, 20, [46, 47]),
        line(1500, 600, 10, [46, 48]),
    )
    trace = read_trace(path)
    assert trace.block_size == 512
    assert trace.requests[1] == TraceRequest(1500.0, 600, 10, (46, 48))
    assert trace.duration_ms == 1500


def test_written_traces_read_back_with_their_block_size(tmp_path: Path) -> None:
    requests = chat_trace(ChatTraceShape(conversations=5, block_size=16))
    buffer = io.StringIO()
    assert write_trace(buffer, requests, 16) == len(requests)
    path = tmp_path / "t.jsonl"
    path.write_text(buffer.getvalue())
    trace = read_trace(path)
    assert trace.block_size == 16
    assert list(trace.requests) == requests
    assert json.loads(trace_line(requests[0]))["hash_ids"] == list(requests[0].hash_ids)


@pytest.mark.parametrize(
    ("lines", "expected"),
    [
        (
            [line(5), line(4)],
            ":2: timestamp 4 ms is before the previous line's 5 ms; a trace lists requests in",
        ),
        ([line(hash_ids="7")], ":1: hash_ids is a string, not a list of whole numbers"),
        ([line(hash_ids=[1.5])], ":1: hash_ids[0] is float, not a whole number in 0..2**63-1"),
        ([line(hash_ids=[-1])], ":1: hash_ids[0] is -1, not a whole number in 0..2**63-1"),
        ([line(hash_ids=[2**64])], "hash_ids[0] is 18,446,744,073,709,551,616, not a whole number"),
        (
            [line(input_length=2000, hash_ids=[1])],
            ":1: input_length 2,000 at 512 tokens a block needs 4 hash_ids",
        ),
        ([line(input_length=-3)], ":1: input_length -3 is outside 1..100,000,000"),
        ([line(input_length=10**12)], ":1: input_length 1,000,000,000,000 is outside 1..100,000,000"),
        ([line(output_length="many")], ":1: output_length is a string, not a whole number"),
        ([line(timestamp=-1)], ":1: timestamp -1 is outside 0..3.1536e+11"),
        ([line(timestamp=True)], ":1: timestamp is true or false, not a number of milliseconds"),
        (['{"timestamp": NaN, "input_length": 1}'], ":1: holds NaN, which is not a number"),
        (["[1, 2]"], ":1: expected a JSON object with timestamp, input_length, output_length, hash_ids"),
        (['{"messages": []}'], "missing timestamp, input_length, output_length, hash_ids"),
        (["{"], ":1: not valid JSON (Expecting property name enclosed in double quotes at column 1)"),
        (
            [line(0, 1024, 1, [1, 2]), line(1, 1024, 1, [3, 2])],
            ":2: hash_ids[1] = 2 follows a different prefix than on line 1; ids are chained",
        ),
        ([line(block_size=16), line(block_size=32)], ":2: block_size 32 disagrees with line 1's 16"),
        ([line(block_size=0)], ":1: block_size 0 is outside 1..1,048,576"),
    ],
    ids=[
        "backwards",
        "ids-text",
        "ids-float",
        "ids-negative",
        "ids-huge",
        "too-few-ids",
        "negative-length",
        "enormous-length",
        "output-text",
        "negative-time",
        "bool-time",
        "nan",
        "not-object",
        "text-trace",
        "syntax",
        "chain",
        "two-block-sizes",
        "zero-block-size",
    ],
)
def test_bad_lines_name_the_line_the_field_and_the_fix(
    tmp_path: Path, lines: list[str], expected: str
) -> None:
    assert expected in refusal(write_lines(tmp_path, *lines))


def test_a_given_block_size_must_agree_with_the_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path, line(input_length=10, block_size=16))
    assert "block_size 16 disagrees with --trace-block-size 32" in refusal(path, 32)


def test_an_empty_trace(tmp_path: Path) -> None:
    assert "holds no requests" in refusal(write_lines(tmp_path, ""))


def test_a_secret_in_a_bad_line_is_never_quoted(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        line(hash_ids="sk-secret-value-123"),
    )
    assert "sk-secret" not in refusal(path)


def test_a_gigabyte_line_is_refused_after_reading_one_line_s_bound(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as file:
        file.truncate(2**30)  # a sparse gigabyte of zeros without a newline
    started = time.monotonic()
    assert f"longer than {MAX_LINE_BYTES // 2**20} MiB; each line must be one JSON request" in refusal(path)
    assert time.monotonic() - started < 10


def test_a_fifo_is_refused_not_read_forever(tmp_path: Path) -> None:
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    assert "is a pipe, which can be read only once; save it to a file" in refusal(fifo)


def test_a_folder_a_device_and_a_missing_file(tmp_path: Path) -> None:
    assert "is a folder, not a file" in refusal(tmp_path)
    assert "is a device, not a file" in refusal(Path("/dev/zero"))
    assert "no such file; check the path" in refusal(tmp_path / "nope.jsonl")


def test_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"timestamp": "\xe9"}\n')
    assert ":1: not UTF-8 text" in refusal(path)


# ---- windows and whole conversations ----------------------------------------------------------------------


def small_trace(**shape: Any) -> Trace:
    made = ChatTraceShape(**({"conversations": 30, "block_size": 16, "system_tokens": 40} | shape))
    return Trace(made.block_size, tuple(chat_trace(made)))


def test_every_turn_joins_its_own_conversation() -> None:
    # The synthetic trace's conversations are known: a request's conversation is the one whose streams it
    # extends, whichever system prompt they share.
    trace = small_trace(system_prompts=1)
    owners = conversations(trace, list(range(len(trace.requests))))
    assert len(set(owners)) == 30
    for index, request in enumerate(trace.requests):
        earlier = [
            j
            for j in range(index)
            if trace.requests[j].full_blocks(16)
            and request.hash_ids[: trace.requests[j].full_blocks(16)]
            == trace.requests[j].hash_ids[: trace.requests[j].full_blocks(16)]
            and trace.requests[j].full_blocks(16) > 40 // 16  # more than the shared system prompt
        ]
        if earlier:
            assert owners[index] == owners[earlier[-1]]


def test_sampling_keeps_or_drops_whole_conversations() -> None:
    trace = small_trace()
    everything = list(range(len(trace.requests)))
    owners = dict(zip(everything, conversations(trace, everything), strict=True))
    kept = [index for index, _at in select(trace, TraceWindow(sample=0.5, seed=3))]
    kept_owners = {owners[index] for index in kept}
    assert 0 < len(kept_owners) < 30
    assert kept == [index for index in everything if owners[index] in kept_owners]


def test_window_times_start_at_zero_and_scale() -> None:
    trace = small_trace()
    plain = select(trace, TraceWindow(start=3, count=5))
    fast = select(trace, TraceWindow(start=3, count=5, time_scale=0.5))
    assert [index for index, _ in plain] == [3, 4, 5, 6, 7]
    assert plain[0][1] == 0
    expected = (trace.requests[7].timestamp_ms - trace.requests[3].timestamp_ms) / 1000
    assert plain[-1][1] == pytest.approx(expected)
    assert fast[-1][1] == pytest.approx(expected / 2)
    within = select(trace, TraceWindow(duration_s=10))
    assert all(at <= 10 for _, at in within)
    assert len(within) < len(trace.requests)


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        ({"start": -1}, "trace start -1 must be 0 or more"),
        ({"count": 0}, "trace count 0 must be at least 1"),
        ({"sample": 0}, "trace sample 0 must be a share above 0 and at most 1"),
        ({"time_scale": float("inf")}, "time scale inf must be a positive number"),
        ({"duration_s": -5.0}, "trace duration -5.0 must be a positive number of seconds"),
    ],
)
def test_bad_windows_are_refused(window: dict[str, Any], expected: str) -> None:
    with pytest.raises(TraceError, match=expected):
        TraceWindow(**window)


def test_a_start_past_the_end_is_refused() -> None:
    with pytest.raises(TraceError, match="is past the trace's"):
        select(small_trace(conversations=2), TraceWindow(start=10_000))


# ---- engine tokens -----------------------------------------------------------------------------------------


def test_equal_ids_give_equal_tokens_and_different_ids_different_ones() -> None:
    mapping = BlockMapping(512, 32, 32)
    first = engine_request(TraceRequest(0, 1024, 100, (1, 2)), 0, 0.0, mapping)
    second = engine_request(TraceRequest(0, 1300, 100, (1, 3, 4)), 1, 0.0, mapping)
    a, b = prompt_token_ids(first, mapping), prompt_token_ids(second, mapping)
    assert (first.prompt_tokens, second.prompt_tokens) == (64, 64 + 18)  # 276 of 512 -> ceil(17.25)
    assert a[:32] == b[:32] and a[32:64] != b[32:64]
    assert all(TOKEN_LOW <= token < TOKEN_HIGH for token in a + b)
    assert first.output_tokens == 7  # 100 x 32/512 = 6.25, rounded up
    assert (
        prompt_token_ids(first, mapping, vocab_size=2000) != a
        and max(prompt_token_ids(first, mapping, 2000)) < 2000
    )


def test_engine_blocks_are_named_by_their_trace_block_and_place() -> None:
    mapping = BlockMapping(512, 64, 32)
    request = engine_request(TraceRequest(0, 1024, 10, (5, 6)), 0, 0.0, mapping)
    assert request.block_keys(mapping) == ((5, 0), (5, 1), (6, 0), (6, 1))


def test_lengths_are_kept_within_max_model_len_and_the_cut_reported() -> None:
    mapping = BlockMapping(32, 32, 32, max_model_len=256)
    request = engine_request(TraceRequest(0, 320, 20, tuple(range(10))), 0, 0.0, mapping)
    assert (request.prompt_tokens, request.output_tokens) == (236, 20)
    assert request.cut_prompt_tokens == 84 and len(request.hash_ids) == 8
    long_output = engine_request(TraceRequest(0, 64, 1000, (1, 2)), 0, 0.0, mapping)
    assert (long_output.output_tokens, long_output.cut_output_tokens) == (224, 776)
    assert long_output.prompt_tokens + long_output.output_tokens <= 256


def test_tokens_per_block_must_be_a_multiple_of_the_engine_block() -> None:
    with pytest.raises(TraceError, match="is not a multiple of the engine's block size 32; use 32"):
        BlockMapping(512, 48, 32)
