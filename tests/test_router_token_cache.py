"""The router's prompt-token cache gives the served tokenizer's own ids, reusing the tokens of shared
leading text, and turns itself off for a tokenizer it cannot cut exactly."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest

from kvtune.loadgen.text import TextMaker, load_tokenizer
from kvtune.router.prompt_tokens import PromptEncoder, prompt_tokens
from kvtune.router.token_cache import PromptTokenCache


@pytest.fixture(scope="module")
def tokenizer(model_path: str) -> Any:
    return load_tokenizer(model_path)


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_shared_prefixes_reuse_tokens_and_give_the_tokenizers_ids(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer)
    assert encoder.cached
    cache = encoder._cache
    assert cache is not None
    maker, rng = TextMaker(tokenizer), random.Random(3)
    documents = [maker.text(rng.randrange(60, 900), f"doc-{i}") for i in range(12)]
    endings = ["", " ", "  x", "\n\nAnd then: ", "é!", "\t", "12345", "'s", " Ça va?"]
    for index in range(300):
        document = rng.choice(documents)
        prompt = (
            document[: rng.randrange(len(document) + 1)] + rng.choice(endings) + maker.text(20, str(index))
        )
        assert encoder.encode(prompt) == tokenizer.encode(prompt), prompt[-80:]
    assert cache.hits > 100  # the shared documents' tokens were reused, not only recomputed


def test_chats_match_the_chat_templates_ids(tokenizer: Any) -> None:
    encoder, maker = PromptEncoder(tokenizer), TextMaker(tokenizer)
    system = maker.text(700, "system")
    messages = [{"role": "system", "content": system}]
    for turn in range(4):
        messages.append({"role": "user", "content": maker.text(40, f"q{turn}")})
        body = {"messages": messages}
        assert prompt_tokens(encoder, body, "/v1/chat/completions") == template_ids(tokenizer, messages)
        messages.append({"role": "assistant", "content": maker.text(16, f"a{turn}")})
    assert encoder._cache is not None and encoder._cache.hits >= 3  # each turn reused the conversation so far


def test_the_cache_stays_within_its_capacity(tokenizer: Any) -> None:
    cache = PromptTokenCache(tokenizer.backend_tokenizer, chunk_chars=64, capacity=50)
    maker = TextMaker(tokenizer)
    for index in range(40):
        text = maker.text(200, f"t{index}")
        assert cache.encode(text) == tokenizer.encode(text)
    assert 0 < len(cache._cuts) <= 50


@dataclass
class _Encoding:
    ids: list[int]
    offsets: list[tuple[int, int]]


class MarksTheStart:
    """A tokenizer that marks the start of every text it tokenises (as SentencePiece's prefix space does):
    a text cut in two would carry the mark twice."""

    def encode(self, sequence: str, add_special_tokens: bool = True) -> _Encoding:
        return _Encoding(
            [0] + [ord(c) for c in sequence], [(0, 0)] + [(i, i + 1) for i in range(len(sequence))]
        )


def test_a_tokenizer_that_cannot_be_cut_is_used_whole() -> None:
    cache = PromptTokenCache(MarksTheStart(), chunk_chars=16)
    assert not cache.exact
    text = "word " * 40
    assert cache.encode(text) == [0] + [ord(c) for c in text]
    assert cache.encode(text + "more") == [0] + [ord(c) for c in text + "more"]
    assert cache.hits == 0 and len(cache._cuts) == 0
