"""The shipped default profile on a real vLLM engine: it answers, and prefix caching pays."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from kvtune import metrics, openai_client
from kvtune.engine import Engine
from tests.prompts import long_text

pytestmark = pytest.mark.engine

HITS = "vllm:prefix_cache_hits_total"


def test_answers_capital_of_france(default_engine: Engine, http: httpx.Client) -> None:
    profile = default_engine.profile
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answer = openai_client.chat(http, default_engine.url, profile.api_model_name, messages)
    assert "Paris" in answer


def test_engine_reports_the_kv_pool_the_profile_asked_for(default_engine: Engine, http: httpx.Client) -> None:
    capacity = metrics.KvCapacity.from_samples(metrics.scrape(default_engine.url, http))
    assert capacity is not None
    assert capacity.prefix_caching
    assert capacity.block_size == default_engine.profile.effective_block_size
    # The engine's real pool matches kvtune's arithmetic for the profile it runs.
    assert capacity.tokens == default_engine.profile.kv_capacity_tokens()


def test_prefix_caching_pays(default_engine: Engine, http: httpx.Client, model_path: str) -> None:
    profile = default_engine.profile
    system = long_text("prefix-caching")
    first = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which note mentions a raven?"},
    ]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise note 3."}]

    cold = openai_client.stream_chat(http, default_engine.url, profile.api_model_name, first, max_tokens=8)
    hits_before = metrics.total(metrics.scrape(default_engine.url, http), HITS)
    warm = openai_client.stream_chat(http, default_engine.url, profile.api_model_name, second, max_tokens=8)
    hits_after = metrics.total(metrics.scrape(default_engine.url, http), HITS)

    assert cold.prompt_tokens is not None and cold.prompt_tokens >= 1500
    assert cold.ttft is not None and warm.ttft is not None
    assert warm.ttft <= 0.25 * cold.ttft, f"TTFT cold {cold.ttft:.2f} s, with cached prefix {warm.ttft:.2f} s"

    tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
    # The shared prefix is what both rendered prompts (chat template included) have in common.
    texts = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (first, second)
    ]
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    shared = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
    full_blocks = shared // profile.effective_block_size
    assert full_blocks >= 10
    assert hits_after - hits_before >= full_blocks * profile.effective_block_size
