"""fp8 KV on real engines: the same budget holds about twice the tokens, and greedy answers stay sensible.

vLLM's CPU build keeps an fp8 KV cache only on CPUs with AVX-512 or AMX. On such a host the session's default
engine runs the shipped profile's fp8 KV and is compared with the 16-bit engine at the same 1 GiB budget (KV
capacity depends on the KV dtype only, not on the weights). On any other host, kvtune refuses the fp8 profile
for the same reason vLLM gives, and the capacity comes from vLLM's own KV sizing, which it logs before its
attention backend refuses.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from kvtune import metrics, openai_client
from kvtune.engine import Engine, EngineError, free_port
from kvtune.profile import EngineProfile
from tests.helpers import ARTIFACTS, SIXTEEN_BIT, default_profile_data, vllm_keeps_fp8_kv

pytestmark = pytest.mark.engine

# Fixed prompts and a word each greedy answer must contain.
PROMPTS = {
    "What is the capital of France?": "Paris",
    "What is the capital of Germany?": "Berlin",
    "What is the capital of Japan?": "Tokyo",
    "What is the chemical formula of water?": "H2O",
    "What is 2+2?": "4",
}
KV_SIZE_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


def greedy_answers(engine: Engine) -> dict[str, str]:
    with httpx.Client(timeout=300) as http:
        return {
            prompt: openai_client.chat(
                http,
                engine.url,
                engine.profile.api_model_name,
                [{"role": "user", "content": prompt}],
                max_tokens=16,
            )
            for prompt in PROMPTS
        }


def assert_sensible(answers: dict[str, str]) -> None:
    """Four of the five greedy answers name the expected word: a broken KV cache gets none right, while a
    small model's greedy path may flip on one prompt when its cached blocks were computed in another
    batch (numerics differ slightly with batch shape)."""
    wrong = {prompt: answer for prompt, answer in answers.items() if PROMPTS[prompt] not in answer}
    assert len(wrong) <= 1, f"wrong answers: {wrong}"


def capacity_of(engine: Engine) -> metrics.KvCapacity:
    capacity = metrics.KvCapacity.from_samples(metrics.scrape(engine.url))
    assert capacity is not None
    return capacity


def test_fp8_doubles_kv_tokens_at_the_same_budget(
    model_path: str, default_engine: Engine, bf16_engine: Engine
) -> None:
    auto_profile = bf16_engine.profile
    auto = capacity_of(bf16_engine)
    assert_sensible(greedy_answers(bf16_engine))
    assert auto.cache_dtype == "auto"

    # What this host really runs for the shipped fp8 profile, as the engine reports it.
    default = capacity_of(default_engine)
    assert default_engine.profile.kv_cache_memory_bytes == auto_profile.kv_cache_memory_bytes
    fp8_data = default_profile_data(name="kv-fp8", **(SIXTEEN_BIT | {"kv_cache_dtype": "fp8"}))
    if vllm_keeps_fp8_kv():
        assert default.cache_dtype == "fp8", "vLLM keeps fp8 KV here, yet kvtune fell back"
        EngineProfile.model_validate(fp8_data)  # kvtune accepts fp8 KV without a fallback here
        assert_sensible(greedy_answers(default_engine))
        fp8_tokens = default.tokens
    else:
        assert default.cache_dtype == "auto", "vLLM refuses fp8 KV here, yet the engine reports it"
        with pytest.raises(ValidationError, match="AVX-512 or AMX"):
            EngineProfile.model_validate(fp8_data)
        # Bypass kvtune's refusal to show vLLM refuses for the same reason, after sizing the pool.
        log_path = ARTIFACTS / "kv-fp8.log"
        log_path.unlink(missing_ok=True)
        unchecked = auto_profile.model_copy(
            update={"kv_cache_dtype": "fp8", "name": "kv-fp8", "port": free_port()}
        )
        with (
            pytest.raises(EngineError, match="AVX-512 or AMX"),
            Engine(unchecked, log_path, model_path=model_path),
        ):
            pass
        sizes = KV_SIZE_LINE.findall(Path(log_path).read_text())
        assert sizes, "vLLM logged no KV cache size"
        fp8_tokens = int(sizes[-1].replace(",", ""))
    assert fp8_tokens >= 1.9 * auto.tokens, f"fp8 {fp8_tokens} vs auto {auto.tokens} KV tokens"
