"""Workloads are sized in the served model's tokens, share what they promise, and reject bad replay input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvtune.loadgen.pacing import ArrivalSchedule
from kvtune.loadgen.text import TextMaker, load_tokenizer
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
    return TextMaker(load_tokenizer(model_path))


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


def test_shared_prefix_default_shares_the_system_prompt(maker: TextMaker) -> None:
    workload = SharedPrefix(maker, system_tokens=120, user_tokens=40)
    a, b = (workload.next_request(i, Conversation()).messages for i in range(2))
    assert a and b and a[0] == b[0] and a[1] != b[1]


def test_no_reuse_shares_nothing(maker: TextMaker) -> None:
    workload = SharedPrefix(maker, system_tokens=120, user_tokens=40, reuse=0.0)
    a, b = (workload.next_request(i, Conversation()).messages for i in range(2))
    assert a and b and a[0]["content"][:20] != b[0]["content"][:20]


def test_reuse_out_of_range_is_refused(maker: TextMaker) -> None:
    with pytest.raises(WorkloadError, match=r"--prefix-reuse 1\.5 must be between 0 and 1"):
        SharedPrefix(maker, reuse=1.5)


def test_long_doc_qa_cycles_documents(maker: TextMaker) -> None:
    workload = LongDocQA(maker, num_docs=2, doc_tokens=200, question_tokens=10)
    docs = [workload.next_request(i, Conversation()).messages[0]["content"] for i in range(4)]  # type: ignore[index]
    assert docs[0] == docs[2] != docs[1] == docs[3]


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
