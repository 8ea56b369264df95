"""The fp8-KV quality gate: an fp8 KV config may only win a sweep if it answers like the same config at 16 bit.

fp8 KV doubles the tokens a pool holds, but it rounds every cached key and value. The gate measures the cost
on a fixed prompt set, greedy: the share of output tokens equal to the 16-bit reference's, and the mean
absolute difference of the prompt tokens' log-probs. The first catches answers that change; the second sees
numerical damage before it flips a greedy token, on every prompt token, not just the ones generated.

The reference is generated once per sweep run (it depends only on the base config and the prompts) and
cached as JSON in the run folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator

from kvtune import metrics
from kvtune.config_errors import existing_file
from kvtune.profile import EngineProfile
from kvtune.sweep.records import QualityRecord

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


class QualityGate(BaseModel):
    """When and how strictly an fp8 KV config's greedy outputs must match its 16-bit KV reference."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Check fp8 KV configs before they may win the sweep.")
    prompts_file: Path | None = Field(
        None,
        description="Prompts, one a line (blank lines skipped, a literal \\n stands for a newline); relative "
        "to the spec's folder. Default: a built-in set of 12 short varied prompts.",
    )
    max_tokens: int = Field(32, ge=1, description="Greedy output tokens per prompt.")
    min_token_agreement: float = Field(
        0.9,
        ge=0,
        le=1,
        description="Least share of output token positions equal to the reference's; positions past the "
        "shorter output count as disagreement.",
    )
    max_logprob_divergence: float = Field(
        0.05,
        gt=0,
        description="Largest mean |delta log p| of the prompt tokens against the reference (nats). "
        "fp32 vs bf16 weights differ by ~0.01; a model with 5% weight noise by ~0.1.",
    )

    @field_validator("prompts_file")
    @classmethod
    def _resolve_prompts_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return None if value is None else existing_file(value, info, "prompts file")

    def prompts(self) -> list[str]:
        """The prompt set: the file's lines, or the built-in default."""
        if self.prompts_file is None:
            return list(DEFAULT_PROMPTS)
        lines = self.prompts_file.read_text().splitlines()
        prompts = [line.replace("\\n", "\n") for line in lines if line.strip()]
        if not prompts:
            raise ValueError(f"prompts file {str(self.prompts_file)!r} has no prompts; write one a line")
        return prompts


class Generation(BaseModel):
    """One prompt's greedy output and how likely the model found the prompt itself, token by token."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    prompt_token_ids: list[int]
    prompt_logprobs: list[float] = Field(
        description="log p of each prompt token after the first (the first has no context to predict it)"
    )
    output_token_ids: list[int]
    text: str = Field(description="the output, for people reading a failed gate")


_GENERATIONS = TypeAdapter(list[Generation])


def needs_gate(profile: EngineProfile) -> bool:
    """True for an fp8 KV cache; pass the profile the host really runs (after `adapted_to_host`)."""
    return profile.kv_cache_dtype.startswith("fp8")


def reference_profile(profile: EngineProfile) -> EngineProfile:
    """The same config with a 16-bit KV cache (the model's dtype): what an fp8 config is judged against.

    Where a 16-bit pool of the same bytes cannot hold one max_model_len sequence (a budget sized for fp8),
    the explicit budget is doubled: 16-bit KV takes twice the bytes per token, so the reference keeps the
    candidate's token capacity, and the pool's size does not change a greedy output.
    """
    update: dict[str, Any] = {"kv_cache_dtype": "auto", "kv_cache_dtype_fallback": None}
    reference = profile.model_copy(update=update)
    if reference.capacity_problem() and reference.kv_cache_memory_bytes is not None:
        update["kv_cache_memory_bytes"] = 2 * int(reference.kv_cache_memory_bytes)
    return EngineProfile.model_validate(profile.model_dump() | update)


def _parse_choice(prompt: str, choice: dict[str, Any]) -> Generation:
    prompt_ids: list[int] = choice["prompt_token_ids"]
    entries: list[dict[str, Any] | None] = choice["prompt_logprobs"]
    # Entry i maps token ids (JSON keys are strings) to log-probs at position i; the prompt's own token is
    # always among them. Position 0 is None: nothing precedes the first token.
    logprobs = [
        float(entry[str(token)]["logprob"])
        for token, entry in zip(prompt_ids, entries, strict=True)
        if entry is not None
    ]
    return Generation(
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=logprobs,
        output_token_ids=choice["token_ids"],
        text=choice["text"],
    )


def generate(
    client: httpx.Client, url: str, model: str, prompts: list[str], max_tokens: int
) -> list[Generation]:
    """Greedy completions of each prompt, with the prompt's log-probs and the output's token ids.

    One request per prompt, in order: batching prompts together would let batch composition change the
    numerics, and the reference and the candidate must differ only by their KV dtype.
    """
    generations = []
    for prompt in prompts:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            # vLLM extensions: 0 = the prompt token's own log-prob only (no top-k alternatives), and the
            # token ids of prompt and output (ids, not text: two texts can match while the tokens differ).
            "prompt_logprobs": 0,
            "return_token_ids": True,
        }
        response = client.post(f"{url}/v1/completions", json=body)
        if response.status_code != 200:
            raise httpx.HTTPStatusError(
                f"{response.status_code} from {url}/v1/completions: {response.text[:500]}",
                request=response.request,
                response=response,
            )
        generations.append(_parse_choice(prompt, response.json()["choices"][0]))
    return generations


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
        if ref.prompt_token_ids != cand.prompt_token_ids:
            raise ValueError(
                f"prompt {ref.prompt!r} tokenizes differently in reference and candidate: they do not serve "
                "the same model or tokenizer, so their log-probs cannot be compared"
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
    """Write generations as JSON (the sweep's cached 16-bit reference); atomically, so a reader never
    sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(_GENERATIONS.dump_json(generations, indent=2))
    partial.replace(path)


def load_generations(path: Path) -> list[Generation]:
    return _GENERATIONS.validate_json(path.read_bytes())
