"""The fp8-KV quality gate: an fp8 KV config may only win a sweep if it answers like its 16-bit KV twin.

fp8 KV doubles the tokens a pool holds, but it rounds every cached key and value. The gate measures the cost
on a fixed prompt set against the same config with the model's own KV dtype, 16-bit (32 for fp32 weights):
the reference. Two figures:

- token agreement: the share of output positions where the candidate's greedy choice is the reference's;
- log-prob divergence: the mean |delta log p| of the prompt tokens, which sees numerical damage before it
  flips a greedy choice, on every prompt token.

The reference generates its greedy outputs once; every engine (the reference too) is then scored along those
outputs, teacher-forced: its greedy choice at each position given the prompt and the reference's output
before it. Comparing free-running outputs instead lets one near-tie flip early in an output turn every later
position into a disagreement. Measured on SmolLM2-135M (12 prompts x 32 tokens, vLLM CPU): bf16 instead of
fp32 weights, a benign change, kept 72% of free-running positions (5 of its 6 first flips were near-ties,
top-2 margins under 0.08 nats) but 97% of teacher-forced choices; fp8 KV, simulated in fp32 transformers,
53% vs 96%. Scoring also costs a candidate only one prefill per prompt (5 s here, vs 60 s to generate).

vLLM's CPU attention reads every key and value back from the (fp8) cache, prefill included, so scoring
prefills do see the fp8 rounding. The reference is generated once per sweep run (it depends only on the base
config and the prompts) and cached as JSON in the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator

from kvtune import kv_math, metrics
from kvtune.config_errors import DocumentModel, existing_file
from kvtune.documents import read_text
from kvtune.files import write_atomic
from kvtune.profile import EngineProfile
from kvtune.sweep.records import QualityRecord, read_record

# Short and varied (facts, arithmetic, a list, code, free text): each exercises a different kind of
# continuation, and short prompts keep the gate cheap on slow (bf16-on-AVX2) engines. Raw completions, not
# chat: the gate compares two engines on the same text, it does not need the chat template.
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Water is made of hydrogen and",
    "The largest planet in our solar system is",
    "2 + 2 = 4. 3 + 5 = 8. 7 + 6 =",
    "The first five prime numbers are",
    "Three colors of the rainbow:\n1.",
    "def add(a, b):\n    return",
    "for i in range(3):\n    print(",
    "Q: How many days are in a week?\nA:",
    "The sun rises in the east and sets in the",
    "Once upon a time, a little fox",
    "Photosynthesis is the process by which plants",
)


class QualityGate(DocumentModel):
    """When and how strictly an fp8 KV config's greedy outputs must match its 16-bit KV reference."""

    enabled: bool = Field(True, description="Check fp8 KV configs before they may win the sweep.")
    prompts_file: Path | None = Field(
        None,
        description="Prompts, one a line (blank lines skipped, a literal \\n stands for a newline); relative "
        "to the spec's folder. Default: a built-in set of 12 short varied prompts.",
    )
    max_tokens: int = Field(32, ge=1, description="Greedy output tokens per prompt (of the reference).")
    min_token_agreement: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Least share of output positions where the candidate's greedy choice, given the "
        "reference's output so far, is the reference's; positions past the shorter output disagree. "
        "Measured: bf16 vs fp32 weights 0.97, simulated fp8 KV 0.95-0.96, 5% weight noise 0.78.",
    )
    max_logprob_divergence: float = Field(
        0.15,
        gt=0,
        description="Largest mean |delta log p| of the prompt tokens against the reference, in nats. "
        "Measured: bf16 vs fp32 weights 0.048, simulated fp8 KV 0.07 (e4m3) to 0.13 (e5m2), 2% weight "
        "noise 0.18, 5% weight noise 0.46.",
    )

    @field_validator("prompts_file")
    @classmethod
    def _resolve_prompts_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else existing_file(value, info, "prompts file")

    def prompts(self) -> list[str]:
        """The prompt set: the file's lines, or the built-in default."""
        if self.prompts_file is None:
            return list(DEFAULT_PROMPTS)
        lines = read_text(self.prompts_file, "a text file of prompts, one a line").splitlines()
        prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"prompts file {str(self.prompts_file)!r} has no prompts; write one a line")
        return prompts


class Generation(BaseModel):
    """One engine on one prompt: how likely it finds the prompt, and its greedy choices along an output."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    prompt_token_ids: list[int]
    prompt_logprobs: list[float] = Field(
        description="log p of each prompt token after the first (nothing precedes the first to predict it)"
    )
    continuation_ids: list[int] = Field(
        description="the reference's free-running greedy output, along which every engine is scored"
    )
    output_token_ids: list[int] = Field(
        description="this engine's greedy choice at each continuation position, given the prompt and the "
        "continuation before it"
    )
    text: str = Field(description="the choices as text, for people reading a failed gate")


_GENERATIONS = TypeAdapter(list[Generation])


def needs_gate(profile: EngineProfile) -> bool:
    """True for an fp8 KV cache; pass the profile the host really runs (after `adapted_to_host`)."""
    return kv_math.is_fp8(profile.kv_cache_dtype)


def reference_profile(profile: EngineProfile) -> EngineProfile:
    """The same config with the model's own KV dtype ("auto"): what an fp8 config is judged against.

    Where that pool of the same bytes cannot hold one max_model_len sequence (a budget sized for fp8), the
    explicit budget grows by the ratio of bytes per token (2x for 16-bit models, 4x for fp32): the reference
    keeps the candidate's token capacity, and the pool's size does not change a greedy output.
    """
    update: dict[str, Any] = {"kv_cache_dtype": "auto", "kv_cache_dtype_fallback": None}
    reference = profile.model_copy(update=update)
    geometry = kv_math.lookup_geometry(profile.model)
    budget = reference.kv_cache_memory_bytes
    if reference.capacity_problem() and geometry is not None and budget is not None:
        auto = geometry.kv_bytes_per_token("auto", profile.dtype)
        own = geometry.kv_bytes_per_token(profile.kv_cache_dtype, profile.dtype)
        update["kv_cache_memory_bytes"] = -(-int(budget) * auto // own)
    return EngineProfile.model_validate(profile.model_dump() | update)


def _post_completion(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(f"{url}/v1/completions", json=body)
    if response.status_code != 200:
        raise httpx.HTTPStatusError(
            f"{response.status_code} from {url}/v1/completions: {response.text[:500]}",
            request=response.request,
            response=response,
        )
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def _greedy_choice(token: int, entry: dict[str, Any]) -> tuple[int, str]:
    """The rank-1 token of a prompt-logprobs entry (the scored token itself when it ties for first)."""
    own = entry[str(token)]
    if own["rank"] == 1:
        return token, own.get("decoded_token") or ""
    best_id, best = min(entry.items(), key=lambda item: item[1]["rank"])
    return int(best_id), best.get("decoded_token") or ""


def _score(
    client: httpx.Client, url: str, model: str, prompt: str, prompt_ids: list[int], continuation: list[int]
) -> Generation:
    """One prefill of prompt + continuation: the prompt's log-probs and the greedy choice at each position."""
    body = {
        "model": model,
        "prompt": prompt_ids + continuation,  # token ids: no re-tokenization can shift a position
        "max_tokens": 1,  # vLLM needs one output token; only the prompt's log-probs are used
        "temperature": 0.0,
        # vLLM extension: per prompt token, its own log-prob and rank plus the top-1 alternative.
        "prompt_logprobs": 1,
    }
    entries: list[dict[str, Any] | None] = _post_completion(client, url, body)["prompt_logprobs"]
    tokens = prompt_ids + continuation
    logprobs = [float(e[str(t)]["logprob"]) for t, e in zip(tokens, entries, strict=True) if e is not None]
    # Entry i predicts token i from the tokens before it; continuation position j is entry n + j.
    choices = [
        _greedy_choice(t, e) for t, e in zip(continuation, entries[len(prompt_ids) :], strict=True) if e
    ]
    return Generation(
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=logprobs[: len(prompt_ids) - 1],
        continuation_ids=continuation,
        output_token_ids=[token for token, _text in choices],
        text="".join(text for _token, text in choices),
    )


def generate(
    client: httpx.Client, url: str, model: str, prompts: list[str], max_tokens: int
) -> list[Generation]:
    """The reference: each prompt's greedy output, then the engine scored along it (see `follow`).

    Scoring the reference too compares prefill with prefill: a decode step and a prefill may round
    differently, and a near-tie must not count against the candidate for the reference's own rounding.
    One request at a time, in order: batching would let batch composition change the numerics.
    """
    generations = []
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,  # vLLM extension: ids, as text can match while the tokens differ
        }
        choice = _post_completion(client, url, body)
        generations.append(
            _score(client, url, model, prompt, choice["prompt_token_ids"], choice["token_ids"])
        )
    return generations


def follow(client: httpx.Client, url: str, model: str, reference: list[Generation]) -> list[Generation]:
    """A candidate engine scored along the reference's outputs: one prefill per prompt, no generation."""
    return [
        _score(client, url, model, ref.prompt, ref.prompt_token_ids, ref.continuation_ids)
        for ref in reference
    ]


def served_kv_cache_dtype(url: str, client: httpx.Client | None = None) -> str:
    """The KV dtype an engine really runs, from its `vllm:cache_config_info` metric."""
    return metrics.cache_config(metrics.scrape(url, client)).get("cache_dtype", "auto")


def token_agreement(reference: list[Generation], candidate: list[Generation]) -> float:
    """Share of output positions (over all prompts) where both chose the same token.

    Each prompt counts max(len) positions, so a shorter or longer output counts its missing tail as
    disagreement. Two empty outputs agree.
    """
    same = positions = 0
    for ref, cand in zip(reference, candidate, strict=True):
        same += sum(a == b for a, b in zip(ref.output_token_ids, cand.output_token_ids, strict=False))
        positions += max(len(ref.output_token_ids), len(cand.output_token_ids))
    return same / positions if positions else 1.0


def logprob_divergence(reference: list[Generation], candidate: list[Generation]) -> float:
    """Mean |delta log p| over all prompt tokens of all prompts (nats)."""
    deltas = [
        abs(a - b)
        for ref, cand in zip(reference, candidate, strict=True)
        for a, b in zip(ref.prompt_logprobs, cand.prompt_logprobs, strict=True)
    ]
    return sum(deltas) / len(deltas) if deltas else 0.0


def _check_comparable(reference: list[Generation], candidate: list[Generation]) -> None:
    if [g.prompt for g in reference] != [g.prompt for g in candidate]:
        raise ValueError(
            "the reference was generated from other prompts than the candidate; regenerate the reference"
        )
    for ref, cand in zip(reference, candidate, strict=True):
        if ref.prompt_token_ids != cand.prompt_token_ids or len(ref.prompt_logprobs) != len(
            cand.prompt_logprobs
        ):
            raise ValueError(
                f"prompt {ref.prompt!r} tokenizes differently in reference and candidate: they do not serve "
                "the same model or tokenizer, so their log-probs cannot be compared"
            )
        if ref.continuation_ids != cand.continuation_ids:
            # Choices along different outputs are not the same decisions: score candidates with `follow`.
            raise ValueError(
                f"prompt {ref.prompt!r}: the candidate was scored along another output than the reference's; "
                "get candidates with follow(..., reference), not generate()"
            )


def compare(
    reference: list[Generation],
    candidate: list[Generation],
    gate: QualityGate,
    kv_cache_dtype: str,
    note: str | None = None,
) -> QualityRecord:
    """Judge a candidate's generations against the reference's; a failed record's note says which limit."""
    _check_comparable(reference, candidate)
    agreement = token_agreement(reference, candidate)
    divergence = logprob_divergence(reference, candidate)
    misses = []
    if agreement < gate.min_token_agreement:
        misses.append(f"token agreement {agreement:.3f} < {gate.min_token_agreement}")
    if divergence > gate.max_logprob_divergence:
        misses.append(f"log-prob divergence {divergence:.4f} > {gate.max_logprob_divergence}")
    return QualityRecord(
        token_agreement=agreement,
        logprob_divergence=divergence,
        min_token_agreement=gate.min_token_agreement,
        max_logprob_divergence=gate.max_logprob_divergence,
        passed=not misses,
        kv_cache_dtype=kv_cache_dtype,
        prompts=len(candidate),
        note="; ".join([*([note] if note else []), *misses]) or None,
    )


def save_generations(path: Path, generations: list[Generation]) -> None:
    """Write generations as JSON (the sweep's cached reference), atomically: a reader never sees half."""
    write_atomic(path, _GENERATIONS.dump_json(generations, indent=2))


def load_generations(path: Path) -> list[Generation]:
    return read_record(_GENERATIONS, path, "the quality gate's reference generations")
