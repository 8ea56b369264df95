"""The fp8-KV quality gate: its arithmetic (fast), and on real engines that it fails a damaged model and
passes the shipped fp8 config, or on a host without fp8 KV a benign precision change.

Engine tests reuse the session's default engine as the reference and start at most two engines of their own.
On an AVX-512/AMX host the default engine runs fp8 KV: the fp8 test then starts the auto-KV reference and
scores the default engine against it. Elsewhere the default engine fell back to auto (fp32) KV: it is the
reference, and bf16 weights stand in for the candidate, a change the gate must accept as fp8 KV should be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from kvtune.engine import Engine, free_port
from kvtune.profile import EngineProfile
from kvtune.sweep.quality import (
    DEFAULT_PROMPTS,
    Generation,
    QualityGate,
    compare,
    follow,
    generate,
    load_generations,
    needs_gate,
    reference_profile,
    save_generations,
    served_kv_cache_dtype,
)
from tests.damaged_model import damage_model
from tests.helpers import ARTIFACTS, ProfileFactory, default_profile_data, vllm_keeps_fp8_kv

# 5% of each tensor's std: the model still writes fluent text and keeps ~78% of the reference's greedy
# choices, but its answers change (7 + 6 = 12; primes 2, 3, 4, 5, 6) and prompt log-probs move ~0.46 nats.
DAMAGE_NOISE = 0.05
GATE = QualityGate()


def gen(
    choices: list[int], logprobs: list[float] | None = None, prompt: str = "p", along: list[int] | None = None
) -> Generation:
    """An engine's greedy `choices` along the output `along` (default: its own choices, as a reference)."""
    logprobs = [-1.0, -2.0] if logprobs is None else logprobs
    return Generation(
        prompt=prompt,
        prompt_token_ids=list(range(len(logprobs) + 1)),
        prompt_logprobs=logprobs,
        continuation_ids=choices if along is None else along,
        output_token_ids=choices,
        text="",
    )


# ---- compare(): fast, no engine ----------------------------------------------------------------------------


def test_identical_generations_agree_fully() -> None:
    reference = [gen([1, 2, 3]), gen([4, 5], prompt="q")]
    record = compare(reference, [g.model_copy() for g in reference], GATE, "fp8")
    assert (record.token_agreement, record.logprob_divergence, record.passed) == (1.0, 0.0, True)
    assert record.prompts == 2 and record.kv_cache_dtype == "fp8" and record.note is None


@pytest.mark.parametrize(
    ("candidate", "agreement"),
    [
        ([1, 2, 9, 4], 3 / 4),  # one different token
        ([1, 2], 2 / 4),  # stopped early: the reference's tail counts as disagreement
        ([1, 2, 3, 4, 5, 6, 7, 8], 4 / 8),  # ran on: its extra positions count as disagreement
        ([], 0.0),
    ],  # following the reference gives equal lengths; the rule matters for hand-made or truncated ones
)
def test_token_agreement_counts_positions(candidate: list[int], agreement: float) -> None:
    record = compare([gen([1, 2, 3, 4])], [gen(candidate, along=[1, 2, 3, 4])], GATE, "fp8")
    assert record.token_agreement == pytest.approx(agreement)


def test_agreement_pools_positions_over_prompts() -> None:
    reference = [gen([1, 2, 3, 4]), gen([5, 6, 7, 8], prompt="q")]
    candidate = [gen([1, 2, 3, 0], along=[1, 2, 3, 4]), gen([5, 6, 7, 8], prompt="q")]
    assert compare(reference, candidate, GATE, "fp8").token_agreement == pytest.approx(7 / 8)


def test_divergence_is_the_mean_absolute_logprob_difference() -> None:
    record = compare([gen([1], [-1.0, -2.0])], [gen([1], [-1.5, -1.9])], GATE, "fp8")
    assert record.logprob_divergence == pytest.approx((0.5 + 0.1) / 2)


def test_thresholds_decide_and_the_note_says_which() -> None:
    gate = QualityGate(min_token_agreement=0.75, max_logprob_divergence=0.25)
    reference = [gen([1, 2, 3, 4], [-1.0, -2.0])]
    at_limits = compare(
        reference, [gen([1, 2, 3, 9], [-1.25, -2.25], along=[1, 2, 3, 4])], gate, "fp8", note="n"
    )
    assert at_limits.passed and at_limits.note == "n"

    worse = compare(reference, [gen([1, 2, 9, 9], [-1.5, -2.5], along=[1, 2, 3, 4])], gate, "fp8", note="n")
    assert not worse.passed
    assert worse.note == "n; token agreement 0.500 < 0.75; log-prob divergence 0.5000 > 0.25"
    only_divergence = compare(reference, [gen([1, 2, 3, 4], [-1.5, -2.5])], gate, "fp8")
    assert not only_divergence.passed and only_divergence.note == "log-prob divergence 0.5000 > 0.25"


def test_other_prompts_or_tokenizers_cannot_be_compared() -> None:
    with pytest.raises(ValueError, match="other prompts"):
        compare([gen([1])], [gen([1], prompt="other")], GATE, "fp8")
    with pytest.raises(ValueError, match="tokenizes differently"):
        compare([gen([1], [-1.0])], [gen([1], [-1.0, -2.0])], GATE, "fp8")
    with pytest.raises(ValueError, match=r"follow\(\.\.\., reference\)"):
        compare([gen([1, 2])], [gen([1, 3])], GATE, "fp8")  # free-running: along its own output


def test_generations_round_trip_through_json(tmp_path: Path) -> None:
    generations = [gen([1, 2], [-0.125, -3.5]), gen([], [], prompt="empty")]
    save_generations(tmp_path / "reference.json", generations)
    assert load_generations(tmp_path / "reference.json") == generations
    assert [p.name for p in tmp_path.iterdir()] == ["reference.json"]


def test_prompts_file_one_a_line(tmp_path: Path) -> None:
    assert QualityGate().prompts() == list(DEFAULT_PROMPTS)
    path = tmp_path / "prompts.txt"
    path.write_text("The capital of France is\n\ndef f():\\n    return\n")
    gate = QualityGate.model_validate({"prompts_file": "prompts.txt"}, context={"base_dir": tmp_path})
    assert gate.prompts() == ["The capital of France is", "def f():\n    return"]
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="no prompts"):
        gate.prompts()
    with pytest.raises(ValidationError, match="does not exist"):
        QualityGate.model_validate({"prompts_file": "missing.txt"}, context={"base_dir": tmp_path})
    with pytest.raises(ValidationError, match="Extra inputs"):
        QualityGate.model_validate({"min_agreement": 0.5})


@pytest.mark.usefixtures("fake_host")  # AVX-512: fp8 KV is kept
def test_reference_profile_is_the_same_config_at_auto_kv() -> None:
    fp8 = EngineProfile.model_validate(default_profile_data(kv_cache_dtype_fallback=None, max_num_seqs=4))
    assert needs_gate(fp8)
    reference = reference_profile(fp8)
    assert not needs_gate(reference)
    changed = {k for k, v in reference.model_dump().items() if v != fp8.model_dump()[k]}
    assert changed == {"kv_cache_dtype"}


@pytest.mark.usefixtures("fake_host")  # AVX-512: fp8 KV is kept
def test_reference_profile_keeps_the_token_capacity_of_an_fp8_sized_budget() -> None:
    # 128 MiB holds 11,648 tokens at fp8 but only 5,760 at bf16: not one 8,192-token sequence.
    fp8 = EngineProfile.model_validate(
        default_profile_data(dtype="bfloat16", kv_cache_memory_bytes="128MiB", kv_cache_dtype_fallback=None)
    )
    reference = reference_profile(fp8)
    assert reference.kv_cache_memory_bytes == 256 * 2**20
    assert reference.kv_capacity_tokens() == fp8.kv_capacity_tokens()


@pytest.mark.fake_host(cpu="avx2")
@pytest.mark.usefixtures("fake_host")
def test_no_gate_where_fp8_fell_back() -> None:
    profile, note = EngineProfile.model_validate(default_profile_data()).adapted_to_host()
    assert note and not needs_gate(profile)


# ---- real engines ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reference(default_engine: Engine) -> Iterator[list[Generation]]:
    """The gate's prompts on the session's default engine, saved and loaded back as a sweep caches it."""
    path = ARTIFACTS / "quality-reference.json"
    with httpx.Client(timeout=600.0) as http:
        generations = generate(
            http, default_engine.url, default_engine.profile.api_model_name, GATE.prompts(), GATE.max_tokens
        )
    save_generations(path, generations)
    assert load_generations(path) == generations
    yield generations


def scored(engine: Engine, reference: list[Generation]) -> tuple[list[Generation], str]:
    """An engine scored along the reference, and the KV dtype it really runs."""
    with httpx.Client(timeout=600.0) as http:
        candidate = follow(http, engine.url, engine.profile.api_model_name, reference)
        return candidate, served_kv_cache_dtype(engine.url, http)


@pytest.mark.engine
def test_reference_scores_itself_perfectly(
    default_engine: Engine, default_reference: list[Generation]
) -> None:
    outputs = [g.continuation_ids for g in default_reference]
    assert sum(map(len, outputs)) >= 8 * len(outputs), outputs
    # Prefill and decode kernels may round differently, but a greedy choice rarely flips between them
    # (none did on the AVX2 host); the gate compares prefill with prefill anyway.
    decoded = [g.model_copy(update={"output_token_ids": g.continuation_ids}) for g in default_reference]
    assert compare(default_reference, decoded, GATE, "auto").token_agreement >= 0.95
    # Scoring is deterministic: the same engine scored again, in new requests, gives the same choices and
    # log-probs, so any disagreement the gate reports comes from the candidate, not from the measurement.
    candidate, kv = scored(default_engine, default_reference)
    assert [g.output_token_ids for g in candidate] == [g.output_token_ids for g in default_reference]
    record = compare(default_reference, candidate, GATE, kv)
    assert (record.token_agreement, record.logprob_divergence, record.passed) == (1.0, 0.0, True)


@pytest.mark.engine
def test_damaged_model_fails_the_gate(
    default_reference: list[Generation], model_path: str, make_profile: ProfileFactory, tmp_path: Path
) -> None:
    damaged = damage_model(Path(model_path), tmp_path / "damaged", relative_noise=DAMAGE_NOISE, seed=0)
    profile = make_profile(name="damaged-model")
    with Engine(profile, ARTIFACTS / "damaged-model.log", model_path=str(damaged)) as engine:
        candidate, kv = scored(engine, default_reference)
    record = compare(default_reference, candidate, GATE, kv)

    figures = record.model_dump()
    assert not record.passed, figures
    # Still a language model (most greedy choices survive), yet both figures miss their limits clearly.
    assert 0.5 < record.token_agreement < GATE.min_token_agreement - 0.05, figures
    assert record.logprob_divergence > 2 * GATE.max_logprob_divergence, figures
    assert record.note is not None
    assert "token agreement" in record.note and "log-prob divergence" in record.note


@pytest.mark.engine
def test_the_default_fp8_config_passes(
    default_engine: Engine,
    default_reference: list[Generation],
    request: pytest.FixtureRequest,
    model_path: str,
    record_property: Callable[[str, object], None],
) -> None:
    # The branch follows what the default engine really runs, as it reports it, and that must be what
    # vLLM's own rule allows on this host: fp8 KV with AVX-512 or AMX, else the model's own KV dtype.
    served = served_kv_cache_dtype(default_engine.url)  # vllm:cache_config_info's cache_dtype
    assert served.startswith("fp8") == vllm_keeps_fp8_kv(), served
    shipped = EngineProfile.model_validate(default_profile_data())
    assert (shipped.host_kv_dtype_problem() is None) == served.startswith("fp8")
    if served.startswith("fp8"):
        branch = "fp8 KV vs auto KV"
        assert needs_gate(default_engine.profile)
        reference_config = reference_profile(default_engine.profile).model_copy(
            update={"name": "kv-auto-reference", "port": free_port()}
        )
        with (
            Engine(reference_config, ARTIFACTS / "kv-auto-reference.log", model_path=model_path) as engine,
            httpx.Client(timeout=600.0) as http,
        ):
            assert served_kv_cache_dtype(engine.url, http) == "auto"
            reference = generate(
                http, engine.url, engine.profile.api_model_name, GATE.prompts(), GATE.max_tokens
            )
        candidate, kv = scored(default_engine, reference)
    else:
        branch = "bf16 weights vs fp32 weights"
        # The shipped profile fell back to the model's own KV dtype: no gate, and it is the reference.
        assert served == "auto" and not needs_gate(default_engine.profile)
        reference = default_reference
        # Started only on this branch: the same 16-bit engine the fp8 test measures its baseline on.
        bf16_engine: Engine = request.getfixturevalue("bf16_engine")
        candidate, kv = scored(bf16_engine, reference)
        assert kv == "auto"
    record = compare(reference, candidate, GATE, kv, note=branch)
    record_property("quality_gate", record.model_dump_json())

    assert record.passed, record.model_dump()
    # A real change of numerics that the gate tolerates, not two identical engines.
    assert record.logprob_divergence > 0, record.model_dump()
