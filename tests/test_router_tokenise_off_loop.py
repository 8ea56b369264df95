"""The router tokenises off its event loop: a long prompt being tokenised holds no other request.

Asserted by order, not speed: a prompt whose tokenising is held open (an Event it waits on) while short
requests, /health and more long prompts arrive; and, with the real Rust tokenizer, a short text tokenised
from start to end while a long one is still inside the tokenizer (which it could not be if the tokenizer
kept the GIL). The shared prompt cache gives every thread the ids a lone tokeniser gives.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from tokenizers import Encoding

from kvtune.router.policies import EngineState, make_policy
from kvtune.router.prompt_tokens import LANE_THREADS, LONG_PROMPT_BYTES
from kvtune.router.proxy import ProxySettings, create_app
from kvtune.router.token_cache import PromptTokenCache
from tests.test_router_hostile import CountingBackend
from tests.test_router_proxy import MODEL, Upstreams

WAIT_S = 30.0  # what waits on another thread gives up after this: a failure, never a hang


@pytest.fixture
def upstreams() -> Iterator[Upstreams]:
    fakes = Upstreams()
    yield fakes
    fakes.stop()


class HeldTokenizer:
    """Long prompts wait in the tokenizer until released (as a context's worth of tokens takes seconds);
    short ones are tokenised at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inside = threading.Semaphore(0)  # one release per long prompt that entered

    def __call__(self, body: dict[str, Any], _endpoint: str) -> list[int]:
        prompt = str(body.get("prompt", ""))
        if len(prompt) > LONG_PROMPT_BYTES:
            self.inside.release()
            if not self.release.wait(WAIT_S):
                raise AssertionError("the long prompt was never released")
        return [1, 2, 3, 4, 5]


def test_short_requests_and_health_are_served_while_long_prompts_are_tokenised(
    upstreams: Upstreams,
) -> None:
    held = HeldTokenizer()
    engines = [
        EngineState(name=n, url=upstreams.url(n), capacity_blocks=100, ready=True) for n in ("e0", "e1")
    ]
    app = create_app(
        ProxySettings(served_model_name=MODEL, block_size=4), engines, make_policy("round_robin"), held,
        registry=CollectorRegistry(),
    )  # fmt: skip
    long_prompt = "word " * (LONG_PROMPT_BYTES // 4)
    with TestClient(app) as client, ThreadPoolExecutor(8) as pool:
        post = lambda prompt: client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})  # noqa: E731
        try:
            # More long prompts than their lane has threads: some are tokenised, the rest queue.
            longs = [pool.submit(post, long_prompt) for _ in range(LANE_THREADS + 1)]
            for _ in range(LANE_THREADS):
                assert held.inside.acquire(timeout=WAIT_S), "a long prompt reached the tokenizer"
            shorts = [pool.submit(post, f"short {index}") for index in range(3)]
            health = pool.submit(client.get, "/health")
            for future in [*shorts, health]:
                assert future.result(timeout=WAIT_S).status_code == 200
            assert not any(future.done() for future in longs), "the long prompts are still being tokenised"
        finally:
            held.release.set()
        assert all(future.result(timeout=WAIT_S).status_code == 200 for future in longs)


class Watched:
    """A Rust tokenizer whose calls on long texts say when they enter and leave it."""

    def __init__(self) -> None:
        self.inner = CountingBackend()._tokenizer
        self.entered = threading.Event()
        self.left = threading.Event()

    def _watched(self, size: int) -> bool:
        return size > LONG_PROMPT_BYTES

    def encode(self, sequence: str, add_special_tokens: bool = True) -> Encoding:
        watched = self._watched(len(sequence))
        self.entered.set() if watched else None
        try:
            return self.inner.encode(sequence, add_special_tokens=add_special_tokens)
        finally:
            self.left.set() if watched else None

    def encode_batch(self, sequences: list[str], add_special_tokens: bool = True) -> list[Encoding]:
        watched = self._watched(sum(map(len, sequences)))
        self.entered.set() if watched else None
        try:
            return list(self.inner.encode_batch(sequences, add_special_tokens=add_special_tokens))
        finally:
            self.left.set() if watched else None


def test_a_short_text_is_tokenised_while_a_long_one_is_inside_the_tokenizer() -> None:
    backend = Watched()
    cache = PromptTokenCache(cast(Any, backend))  # tokenizers' Encoding, as the protocol reads it
    long_text = "a long document, tokenised for a while. " * 50_000  # ~2 MB
    short_text = "a short question?"
    done: dict[str, list[int]] = {}
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(cache.encode, long_text)
        assert backend.entered.wait(WAIT_S)
        short = pool.submit(cache.encode, short_text)
        done["short"] = short.result(timeout=WAIT_S)
        # The short one ran to its end while the long one was still in the Rust tokenizer: the tokenizer
        # let go of the GIL, so neither the event loop nor other prompts wait for a long one.
        assert not backend.left.is_set(), "the long text was done first: the tokenizer held the GIL"
        done["long"] = long.result(timeout=WAIT_S)
    assert done["short"] == backend.inner.encode(short_text).ids
    assert done["long"] == backend.inner.encode(long_text).ids


def test_threads_sharing_the_prompt_cache_get_the_ids_of_a_lone_tokeniser() -> None:
    backend = CountingBackend()
    cache = PromptTokenCache(
        cast(Any, backend), chunk_chars=32, capacity=64
    )  # small: evictions while others read
    rng = random.Random(7)
    words = ["the", "router", "reads", "a", "prompt", "  ", "\n", "Ça", "va?", "12.5", "tokens,"]
    shared = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(4)]
    texts = [
        rng.choice(shared) + " ".join(rng.choice(words) for _ in range(rng.randint(0, 80)))
        for _ in range(300)
    ]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(cache.encode, texts))
    assert got == [backend._tokenizer.encode(text).ids for text in texts]
    assert cache.hits > 0 and len(cache._cuts) <= 64


def test_a_prompt_that_cannot_be_read_is_still_refused_from_its_thread(upstreams: Upstreams) -> None:
    def refuses(_body: dict[str, Any], _endpoint: str) -> list[int]:
        raise TypeError("'prompt' must be a string")

    engines = [EngineState(name="e0", url=upstreams.url("e0"), capacity_blocks=100, ready=True)]
    settings = ProxySettings(served_model_name=MODEL, block_size=4)
    app = create_app(settings, engines, make_policy("round_robin"), refuses)
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={"model": MODEL, "prompt": 3})
    assert answer.status_code == 400 and answer.json()["error"]["message"].startswith(
        "the prompt cannot be read"
    )
    assert upstreams.calls == []
