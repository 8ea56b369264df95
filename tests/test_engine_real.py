"""The shipped default profile on a real vLLM engine: it answers, and prefix caching pays."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from kvtune import metrics, openai_client
from kvtune.engine import Engine
from tests.prompts import CacheCounters, long_text, shared_prefix_tokens

pytestmark = pytest.mark.engine


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


def test_prefix_caching_pays(
    default_engine: Engine,
    http: httpx.Client,
    model_path: str,
    record_property: Callable[[str, object], None],
) -> None:
    """A second chat with the same long system prompt is served from the first one's cached blocks."""
    profile = default_engine.profile
    block = profile.effective_block_size
    system = long_text("prefix-caching")
    first = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which note mentions a raven?"},
    ]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise note 3."}]

    before = CacheCounters.of(default_engine.url, http)
    cold = openai_client.stream_chat(http, default_engine.url, profile.api_model_name, first, max_tokens=8)
    assert cold.prompt_tokens is not None and cold.prompt_tokens >= 1500
    after_cold = before.after(default_engine.url, http, cold.prompt_tokens)
    warm = openai_client.stream_chat(http, default_engine.url, profile.api_model_name, second, max_tokens=8)
    assert warm.prompt_tokens is not None
    after_warm = after_cold.after(default_engine.url, http, warm.prompt_tokens)
    # Recorded, not asserted: how much sooner the first token comes depends on the host and its load.
    record_property("ttft_cold_vs_cached_prefix_s", (cold.ttft, warm.ttft))

    # The first chat's prompt was new to the engine: it found none of it cached.
    assert after_cold.hits - before.hits == 0
    # The second found every whole block of the prefix the two rendered prompts share (chat template
    # included), and no more than that: the engine prefilled only the rest.
    shared = shared_prefix_tokens(model_path, first, second)
    assert shared // block >= 10
    hits = after_warm.hits - after_cold.hits
    assert hits == (shared // block) * block, f"{hits:.0f} cached tokens of a {shared}-token shared prefix"
    # vLLM reports the same reuse to the client, on the answer itself.
    assert warm.cached_tokens in (None, hits)
