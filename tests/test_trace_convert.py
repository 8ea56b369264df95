"""`kvtune trace convert` (a request log as a trace without its text) and `kvtune trace generate` (a
synthetic chat trace), run through kvtune's command line; the tokenizer is a real byte-level BPE saved as a
model folder (tests/test_trace_capture.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.cli import main as cli_main
from kvtune.commands import trace_generate
from kvtune.router.prompt_tokens import PromptEncoder, prompt_tokens
from kvtune.traces.format import read_trace
from kvtune.traces.synthetic import ChatTraceShape
from tests.helpers import default_profile_data
from tests.test_trace_capture import CHAT, COMPLETION, MARKER, save_tiny_tokenizer

SYSTEM = f"You are a careful assistant who never repeats {MARKER}. " * 2  # several blocks of 16


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = cli_main(["trace", *argv])
    except SystemExit as exited:  # argparse's own refusals
        code = int(exited.code or 0)
    return code, " ".join(capsys.readouterr().err.split())


def write_log(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def chat(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_a_log_of_chats_and_prompts_becomes_a_trace_in_time_order_without_its_text(
    tmp_path: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    epoch_ms = 1_767_225_600_000  # Unix time in ms: the trace starts at the earliest line
    log = write_log(tmp_path / "requests.jsonl", [
        {"timestamp": epoch_ms + 2500, "messages": chat("What is 2+2?"), "max_tokens": 40, "model": "x"},
        {"timestamp": epoch_ms, "prompt": f"Complete this: {MARKER}", "output_tokens": 12},
        {"timestamp": epoch_ms + 4000, "messages": chat("And 3+3?"), "max_completion_tokens": 8},
        {"timestamp": epoch_ms + 4000, "prompt": [5, 6, 7], "output_tokens": 0, "max_tokens": 99},
    ])  # fmt: skip
    out = tmp_path / "trace.jsonl"
    code, err = run(capsys, "convert", str(log), "-o", str(out), "--model", str(tokenizer_folder),
                    "--block-size", "16")  # fmt: skip
    assert code == 0, err
    assert "Wrote 4 requests" in err and "1 lines were out of time order and are sorted" in err
    trace = read_trace(out)
    assert trace.block_size == 16
    assert [r.timestamp_ms for r in trace.requests] == [0, 2500, 4000, 4000]
    assert [r.output_length for r in trace.requests] == [12, 40, 8, 0], "output_tokens first, then the caps"
    encoder = PromptEncoder(_load(tokenizer_folder))
    bodies: list[tuple[str, dict[str, Any]]] = [
        (COMPLETION, {"prompt": f"Complete this: {MARKER}"}),
        (CHAT, {"messages": chat("What is 2+2?")}),
        (CHAT, {"messages": chat("And 3+3?")}),
        (COMPLETION, {"prompt": [5, 6, 7]}),
    ]
    assert [r.input_length for r in trace.requests] == [
        len(prompt_tokens(encoder, body, endpoint)) for endpoint, body in bodies
    ]
    first, second = trace.requests[1], trace.requests[2]
    shared = len(SYSTEM) // 16  # the system prompt's whole blocks (one token a byte)
    assert first.hash_ids[:shared] == second.hash_ids[:shared], "a shared system prompt, shared ids"
    assert first.hash_ids[-1] != second.hash_ids[-1]
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 16) for r in trace.requests)
    assert MARKER.encode() not in out.read_bytes()
    # A key per conversion: the same log gives other ids, so two conversions cannot be matched up.
    again = tmp_path / "again.jsonl"
    assert run(capsys, "convert", str(log), "-o", str(again), "--model", str(tokenizer_folder),
               "--block-size", "16")[0] == 0  # fmt: skip
    assert not set(read_trace(again).requests[0].hash_ids) & set(trace.requests[0].hash_ids)


def _load(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def test_lines_without_times_or_output_lengths_take_the_flags(
    tmp_path: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "one"}, "", {"prompt": "two", "timestamp": 50},
                                              {"prompt": "three"}])  # fmt: skip
    out = tmp_path / "trace.jsonl"
    code, err = run(capsys, "convert", str(log), "-o", str(out), "--model", str(tokenizer_folder),
                    "--block-size", "4", "--gap-ms", "100", "--output-tokens", "5")  # fmt: skip
    assert code == 0, err
    trace = read_trace(out)
    assert [r.timestamp_ms for r in trace.requests] == [0, 50, 150]
    assert [r.output_length for r in trace.requests] == [5, 5, 5]


def test_a_profile_gives_the_model_and_the_block_size(
    tmp_path: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(default_profile_data(model=str(tokenizer_folder), block_size=64)))
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "x" * 200, "timestamp": 0, "output_tokens": 1}])
    out = tmp_path / "trace.jsonl"
    code, err = run(capsys, "convert", str(log), "-o", str(out), "--model", str(profile))
    assert code == 0, err
    trace = read_trace(out)
    assert trace.block_size == 64 and len(trace.requests[0].hash_ids) == math.ceil(200 / 64)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "SECRET", not json', "log.jsonl:2: not valid JSON"),
        (["SECRET"], "log.jsonl:2: expected a JSON object with 'messages' or 'prompt'"),
        ({"timestamp": 1, "output_tokens": 1}, "log.jsonl:2: has neither 'messages' (a chat) nor 'prompt'"),
        ({"prompt": "SECRET", "output_tokens": 1}, "log.jsonl:2: no timestamp; give every line a"),
        ({"prompt": "SECRET", "timestamp": "2026-01-01", "output_tokens": 1},
         "log.jsonl:2: timestamp is not a number"),
        ({"prompt": "SECRET", "timestamp": 1}, "log.jsonl:2: no output length; give the line one of"),
        ({"prompt": "SECRET", "timestamp": 1, "max_tokens": -3}, "log.jsonl:2: max_tokens is not a whole"),
        ({"messages": "SECRET", "timestamp": 1, "output_tokens": 1},
         "log.jsonl:2: the prompt cannot be read ('messages' must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "SECRET"}], "prompt": "SECRET", "timestamp": 1,
          "max_tokens": 1},
         "log.jsonl:2: has both 'messages' and 'prompt'"),
        ({"prompt": "", "timestamp": 1, "output_tokens": 1}, "log.jsonl:2: the prompt has no tokens"),
    ],
)  # fmt: skip
def test_a_bad_line_is_refused_by_its_number_with_the_fix_and_nothing_is_written(
    tmp_path: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str], line: Any, expected: str
) -> None:
    good = {"prompt": f"fine {MARKER}", "timestamp": 0, "output_tokens": 1}
    bad = (line if isinstance(line, str) else json.dumps(line)).replace("SECRET", MARKER)
    log = write_log(tmp_path / "log.jsonl", [good, bad])
    out = tmp_path / "trace.jsonl"
    code, err = run(capsys, "convert", str(log), "-o", str(out), "--model", str(tokenizer_folder),
                    "--block-size", "16")  # fmt: skip
    assert code == 2
    assert expected in err
    assert MARKER not in err, "a log line's text is never quoted"
    assert not out.exists()


def test_convert_refuses_a_model_without_a_block_size_and_an_output_it_cannot_write(
    tmp_path: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "a", "timestamp": 0, "output_tokens": 1}])
    code, err = run(
        capsys, "convert", str(log), "-o", str(tmp_path / "t.jsonl"), "--model", str(tokenizer_folder)
    )
    assert code == 2 and "--block-size: give the engines' block size" in err
    code, err = run(capsys, "convert", str(log), "-o", str(tmp_path / "no" / "t.jsonl"), "--block-size", "16")
    assert code == 2 and "its folder" in err and "does not exist" in err


# ---- kvtune trace generate ------------------------------------------------------------------------------


def test_generate_writes_the_synthetic_chat_trace_of_its_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second, other = (tmp_path / name for name in ("a.jsonl", "b.jsonl", "c.jsonl"))
    flags = ["--conversations", "30", "--turns", "3", "--block-size", "16", "--conversation-rate", "2.5"]
    assert run(capsys, "generate", "-o", str(first), *flags, "--seed", "4")[0] == 0
    assert run(capsys, "generate", "-o", str(second), *flags, "--seed", "4")[0] == 0
    assert run(capsys, "generate", "-o", str(other), *flags, "--seed", "5")[0] == 0
    trace = read_trace(first)
    assert trace.block_size == 16 and 30 <= len(trace.requests) <= 90
    assert first.read_bytes() == second.read_bytes() != other.read_bytes(), "a seed gives one trace"


def test_generate_has_a_flag_for_every_field_of_the_shape_and_refuses_bad_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert set(trace_generate.HELP) == set(ChatTraceShape.__dataclass_fields__)
    out = tmp_path / "t.jsonl"
    code, err = run(capsys, "generate", "-o", str(out), "--conversation-rate", "0")
    assert code == 2 and "--conversation-rate: 0 is not a finite number above 0" in err
    code, err = run(
        capsys, "generate", "-o", str(out), "--conversations", "100000", "--system-tokens", "2000"
    )
    assert code == 2 and "more than kvtune generates" in err
    assert not out.exists()
