"""Workloads are sized in the served model's tokens, share what they promise, and reject bad input by flag."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.loadgen.text import TextMaker, load_text_tokenizer, load_tokenizer
from kvtune.loadgen.workload_args import (
    DEFAULT_MAX_TOKENS,
    WORKLOAD_ARGS,
    WORKLOAD_NAMES,
    validate_workload_args,
    workload_sizes,
)
from kvtune.loadgen.workloads import (
    Conversation,
    LongDocQA,
    MultiTurn,
    Replay,
    SharedPrefix,
    WorkloadError,
    load_replay,
)


@pytest.fixture(scope="module")
def maker(model_path: str) -> TextMaker:
    """The tokenizer Locust's processes size prompts with."""
    return TextMaker(load_text_tokenizer(model_path))


def test_the_fast_tokenizer_makes_and_counts_text_as_transformers_does(
    maker: TextMaker, model_path: str
) -> None:
    """tokenizer.json through `tokenizers` alone (what each load step's Locust loads, without importing
    transformers) gives the same prompts, token for token, as the model's transformers tokenizer."""
    reference = TextMaker(load_tokenizer(model_path))
    assert type(maker.tokenizer) is not type(reference.tokenizer)
    for seed, n_tokens in enumerate((1, 7, 64, 333, 1200)):
        text = maker.text(n_tokens, seed)
        assert text == reference.text(n_tokens, seed)
        assert maker.count(text) == reference.count(text) == n_tokens
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>"
    assert maker.tokenizer.encode(chat) == reference.tokenizer.encode(chat)
    ids = reference.tokenizer.encode(chat)
    for skip in (False, True):
        assert maker.tokenizer.decode(ids, skip) == reference.tokenizer.decode(ids, skip_special_tokens=skip)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_text_has_the_asked_token_count(maker: TextMaker) -> None:
    for n in (1, 37, 800):
        assert abs(maker.count(maker.text(n, seed=n)) - n) <= 2  # decode/re-encode may merge at most an edge


def test_shared_prefix_shares_the_target_share(maker: TextMaker) -> None:
    workload = SharedPrefix(maker, system_tokens=300, user_tokens=100, reuse=0.5)
    first, second = (workload.next_request(i, Conversation()) for i in range(2))
    assert first.messages and second.messages
    texts = [m[0]["content"] + m[1]["content"] for m in (first.messages, second.messages)]
    ids = [maker.tokenizer.encode(text) for text in texts]
    assert abs(common_prefix(*ids) - 200) <= 3
    assert first.shared_tokens == 200 and first.prompt_tokens == 400
    assert workload.describe()["target_reuse"] == 0.5


def prompt_ids(maker: TextMaker, workload: SharedPrefix, index: int) -> list[int]:
    messages = workload.next_request(index, Conversation()).messages
    assert messages is not None
    return [i for m in messages for i in maker.tokenizer.encode(m["content"], add_special_tokens=False)]


def test_shared_prefix_default_shares_the_system_prompt(maker: TextMaker) -> None:
    workload = SharedPrefix(maker, system_tokens=120, user_tokens=40)
    first, second = prompt_ids(maker, workload, 0), prompt_ids(maker, workload, 1)
    # Exactly the system prompt's tokens are shared (decode/re-encode may move the edge by a token or two).
    assert abs(common_prefix(first, second) - 120) <= 2, common_prefix(first, second)
    assert workload.describe()["target_reuse"] == 120 / 160


def test_no_reuse_shares_nothing(maker: TextMaker) -> None:
    workload = SharedPrefix(maker, system_tokens=120, user_tokens=40, reuse=0.0)
    first, second = prompt_ids(maker, workload, 0), prompt_ids(maker, workload, 1)
    assert common_prefix(first, second) <= 1, common_prefix(first, second)
    assert workload.next_request(0, Conversation()).shared_tokens == 0


def test_reuse_out_of_range_is_refused(maker: TextMaker) -> None:
    with pytest.raises(
        WorkloadError, match=r"^prefix-reuse: 1\.5 is outside 0\.\.1; give a value within 0\.\.1"
    ):
        SharedPrefix(maker, 800, 400, reuse=1.5)


def test_long_doc_qa_cycles_documents(maker: TextMaker) -> None:
    workload = LongDocQA(maker, num_docs=2, doc_tokens=200, question_tokens=10)
    docs = [workload.next_request(i, Conversation()).messages[0]["content"] for i in range(4)]  # type: ignore[index]
    assert docs[0] == docs[2] != docs[1] == docs[3]
    ids = [maker.tokenizer.encode(doc, add_special_tokens=False) for doc in docs[:2]]
    # Each document is its own 200-token prefix: the two share only the fixed instruction line.
    instruction = maker.tokenizer.encode(
        "Answer questions about this document.\n\n", add_special_tokens=False
    )
    assert common_prefix(*ids) <= len(instruction) + 1


def test_multi_turn_resends_history(maker: TextMaker) -> None:
    workload = MultiTurn(maker, turns=2, turn_tokens=20)
    conversation = Conversation()
    first = workload.next_request(0, conversation)
    workload.record_answer(conversation, "An answer.", 3)
    second = workload.next_request(1, conversation)
    assert second.messages is not None and first.messages is not None
    assert second.messages[: len(first.messages)] == first.messages
    assert second.messages[len(first.messages)] == {"role": "assistant", "content": "An answer."}
    assert second.shared_tokens == 23
    third = workload.next_request(2, conversation)  # the conversation starts over after `turns`
    assert third.messages is not None and len(third.messages) == 2


def test_replay_reads_messages_and_prompts(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    lines = [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}, {"prompt": "Once upon"}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    replay = Replay(path, max_tokens=9)
    assert [r.max_tokens for r in replay.records] == [5, 9]
    assert replay.next_request(3, Conversation()).prompt == "Once upon"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist; pass an existing JSONL file with --replay-file"),
        ("\n\n", "has no requests; add JSONL lines with 'messages' or 'prompt'"),
        ('{"prompt": "a"}\n{"prompt": "b"\n', "r.jsonl:2: not valid JSON"),
        ('{"prompt": "a"}\n{"text": "b"}\n', "r.jsonl:2: expected an object with exactly one of"),
        ('{"messages": []}\n', "r.jsonl:1: 'messages' must be a non-empty list"),
        ('{"prompt": "a", "max_tokens": 0}\n', "r.jsonl:1: 'max_tokens' must be a positive integer"),
    ],
)
def test_replay_errors_name_the_line(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "r.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(WorkloadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_replay(path, 8)


def test_constant_and_poisson_schedules() -> None:
    constant = ArrivalSchedule(rate=4.0, start=100.0)
    assert [constant.next_slot() for _ in range(3)] == [(0, 100.0), (1, 100.25), (2, 100.5)]
    poisson = ArrivalSchedule(rate=10.0, kind="poisson", start=1000.0, seed=1)
    times = [poisson.next_slot()[1] for _ in range(2000)]
    assert 180 < times[-1] - 1000.0 < 220  # 2000 arrivals at 10/s take ~200 s
    assert times == sorted(times) and times[0] == 1000.0
    unset = ArrivalSchedule(rate=1.0)
    assert abs(unset.next_slot()[1] - time.time()) < 1.0  # no start: the first slot is now
    with pytest.raises(ValueError, match="arrival rate must be positive"):
        ArrivalSchedule(rate=0)


# ---- the workloads' own flags: one definition read by validation, Locust and pruning --------------------


def test_validation_types_the_given_flags() -> None:
    given: dict[str, str | int | float] = {
        "system-tokens": "600",
        "--user-tokens": 100,
        "prefix-reuse": "0.5",
    }
    checked = validate_workload_args("shared_prefix", given)
    assert checked == {"system-tokens": 600, "user-tokens": 100, "prefix-reuse": 0.5}
    assert type(checked["system-tokens"]) is int and type(checked["prefix-reuse"]) is float


BAD_ARGS: list[tuple[str, dict[str, str | int | float], str]] = [
    ("shared_prefix", {"sytem-tokens": 800},
     "sytem-tokens: not a flag of the shared_prefix workload; did you mean 'system-tokens'? "
     "its flags: system-tokens, user-tokens, prefix-reuse"),
    ("long_doc_qa", {"zzz": 1},
     "zzz: not a flag of the long_doc_qa workload; its flags: num-docs, doc-tokens, question-tokens"),
    ("shared_prefix", {"system-tokens": "abc"},
     "system-tokens: 'abc' is not an integer; give a whole number, e.g. system-tokens=800"),
    ("shared_prefix", {"system-tokens": 12.5}, "system-tokens: 12.5 is not an integer"),
    ("shared_prefix", {"system-tokens": True}, "system-tokens: True is not a number"),
    ("shared_prefix", {"user-tokens": 0},
     "user-tokens: 0 is below 1; give at least 1, e.g. user-tokens=400"),
    ("multi_turn", {"turns": -3}, "turns: -3 is below 1; give at least 1, e.g. turns=4"),
    ("shared_prefix", {"prefix-reuse": 1.5},
     "prefix-reuse: 1.5 is outside 0..1; give a value within 0..1, e.g. prefix-reuse=0.5"),
    ("shared_prefix", {"prefix-reuse": -0.1}, "prefix-reuse: -0.1 is below 0"),
    ("shared_prefix", {"prefix-reuse": "half"}, "prefix-reuse: 'half' is not a number"),
    ("shared_prefix", {"max-tokens": 8},
     "max-tokens: a load setting, not a flag of the shared_prefix workload"),
    ("replay", {}, "replay-file: the replay workload needs a JSONL file of prompts or chat messages"),
    ("replay", {"replay-file": "/nonexistent/p.jsonl"},
     "replay-file: /nonexistent/p.jsonl does not exist"),
    ("shared_prefx", {}, "'shared_prefx' is not a workload; did you mean 'shared_prefix'?"),
]  # fmt: skip


@pytest.mark.parametrize(("workload", "args", "message"), BAD_ARGS)
def test_bad_workload_args_name_the_flag_and_the_fix(
    workload: str, args: dict[str, str | int | float], message: str
) -> None:
    with pytest.raises(WorkloadError) as error:
        validate_workload_args(workload, args)
    assert str(error.value).startswith(message), str(error.value)


def test_replay_file_is_resolved_against_the_base_folder(tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    checked = validate_workload_args("replay", {"replay-file": "p.jsonl"}, base_dir=tmp_path)
    assert checked == {"replay-file": str(tmp_path / "p.jsonl")}


def test_sizes_fill_in_the_declared_defaults() -> None:
    sizes = workload_sizes("long_doc_qa", {"doc-tokens": 500})
    assert sizes.values == {"num-docs": 2, "doc-tokens": 500, "question-tokens": 32}
    assert sizes.count("num-docs") == 2 and workload_sizes("shared_prefix", {}).share("prefix-reuse") is None


# Runs in a subprocess: importing Locust patches the whole process for gevent.
_PARSE_LOCUST_FLAGS = """
import json, sys
from locust import argument_parser
import kvtune.loadgen.locustfiles.{workload}
options = argument_parser.get_parser().parse_args(sys.argv[1:])
print(json.dumps(vars(options), default=str))
"""


def locust_options(
    workload: str, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    code = _PARSE_LOCUST_FLAGS.format(workload=workload)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          check=False, env=os.environ | (env or {}))  # fmt: skip


@pytest.mark.parametrize("workload", WORKLOAD_NAMES)
def test_locust_registers_each_flag_from_its_definition(workload: str) -> None:
    definitions = WORKLOAD_ARGS[workload]
    env = {arg.env_var: "7" for arg in definitions if arg.kind is int}  # every count through its env var
    defaults, from_env = locust_options(workload), locust_options(workload, env=env)
    assert defaults.returncode == 0 and from_env.returncode == 0, defaults.stderr + from_env.stderr
    parsed, parsed_env = json.loads(defaults.stdout), json.loads(from_env.stdout)
    for arg in definitions:
        assert parsed[arg.dest] == arg.default, arg
        if arg.kind is int:
            assert parsed_env[arg.dest] == 7, arg
    assert parsed["max_tokens"] == DEFAULT_MAX_TOKENS == 64  # one home for the default output length


def test_locust_refuses_a_bad_size_with_the_definitions_reason() -> None:
    result = locust_options("shared_prefix", "--user-tokens", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --user-tokens: 0 is below 1; give at least 1, e.g. user-tokens=400" in result.stderr
