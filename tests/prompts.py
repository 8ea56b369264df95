"""Deterministic long prompts for cache tests (distinct per seed, so tests never share cached prefixes), and
what an engine's prefix cache made of them, read from its own counters."""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from kvtune import metrics

_WORDS = (
    "river mountain engine harbor lantern orchard copper meadow signal archive beacon canyon "
    "delta ember falcon glacier horizon island jasmine kernel lagoon marble nebula oasis prism "
    "quartz raven summit timber umbra valley willow zenith anchor bridge cobalt dune"
).split()


def long_text(seed: str, sentences: int = 160) -> str:
    """About 10 tokens a sentence: 160 sentences is ~1,600 tokens with SmolLM2's tokenizer."""
    rng = random.Random(seed)
    lines = []
    for index in range(sentences):
        words = rng.sample(_WORDS, 6)
        lines.append(f"Note {index}: the {words[0]} near the {words[1]} keeps {words[2]} and {words[3]}.")
    return f"Reference document {seed}.\n" + "\n".join(lines)


@functools.cache
def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer  # slow import, only for the engine tests that need it

    return AutoTokenizer.from_pretrained(model_path)


def chat_prompt_ids(model_path: str, messages: list[dict[str, str]]) -> list[int]:
    """The token ids the engine prefills for a chat: the model's own template, then its tokenizer."""
    tokenizer = _tokenizer(model_path)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def shared_prefix_tokens(model_path: str, first: list[dict[str, str]], second: list[dict[str, str]]) -> int:
    """How many leading prompt tokens two chats share once rendered: what a prefix cache can reuse."""
    a, b = chat_prompt_ids(model_path, first), chat_prompt_ids(model_path, second)
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class CacheCounters:
    """An engine's prefix-cache counters, in prompt tokens: looked up (queries) and found cached (hits)."""

    queries: float
    hits: float

    @classmethod
    def of(cls, url: str, client: httpx.Client) -> CacheCounters:
        samples = metrics.scrape(url, client)
        return cls(
            metrics.total(samples, metrics.PREFIX_CACHE_QUERIES),
            metrics.total(samples, metrics.PREFIX_CACHE_HITS),
        )

    def after(
        self, url: str, client: httpx.Client, prompt_tokens: int, timeout: float = 60.0
    ) -> CacheCounters:
        """The counters once the engine has counted the lookup of a `prompt_tokens` prompt sent since these.

        vLLM counts a lookup when it schedules the request and publishes it with a later step's stats, so
        the scrape right after the answer may not show it yet; this waits for the count, not for a time.
        """
        deadline = time.monotonic() + timeout
        while True:
            now = CacheCounters.of(url, client)
            if now.queries >= self.queries + prompt_tokens:
                return now
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the engine counted {now.queries - self.queries:.0f} queried prompt tokens, "
                    f"not the {prompt_tokens} sent, within {timeout:.0f} s"
                )
            time.sleep(0.2)
