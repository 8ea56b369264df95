"""The sweep's use of the quality gate: one 16-bit reference per run, then each fp8 config against it.

The reference is measured before the candidate's engine starts (one engine at a time: on a GPU two
would compete for memory) and cached in the run folder, so a resumed run does not measure it again.
"""

from __future__ import annotations

from pathlib import Path

from kvtune import openai_client
from kvtune.engine import Engine, free_port
from kvtune.files import derived_name
from kvtune.profile import EngineProfile
from kvtune.sweep.quality import (
    Generation,
    compare,
    follow,
    generate,
    load_generations,
    needs_gate,
    reference_profile,
    save_generations,
    served_kv_cache_dtype,
)
from kvtune.sweep.records import QualityRecord
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.trial import QualityFn

REFERENCE_FILE = "quality-reference.json"


def quality_for(
    spec: SweepSpec, run: Path, profile: EngineProfile, model_path: str | None
) -> QualityFn | None:
    """The gate for a trial of `profile` (as the host runs it); None when its KV cache is not fp8."""
    gate = spec.quality
    if not gate.enabled or not needs_gate(profile):
        return None
    reference = _reference(spec, run, profile, model_path)

    def check(running: EngineProfile) -> QualityRecord:
        with openai_client.client_for(running.api_key()) as client:
            candidate = follow(client, running.url, running.api_model_name, reference)
            dtype = served_kv_cache_dtype(running.url, client)
        return compare(reference, candidate, gate, kv_cache_dtype=dtype)

    return check


def _reference(
    spec: SweepSpec, run: Path, profile: EngineProfile, model_path: str | None
) -> list[Generation]:
    path = run / REFERENCE_FILE
    if path.is_file():
        return load_generations(path)
    reference = reference_profile(profile).model_copy(
        update={"name": derived_name(spec.name, "reference"), "port": free_port(profile.host)}
    )
    gate = spec.quality
    with (
        Engine(reference, run / "quality-reference.log", model_path=model_path) as engine,
        openai_client.client_for(reference.api_key()) as client,
    ):
        generations = generate(client, engine.url, reference.api_model_name, gate.prompts(), gate.max_tokens)
    save_generations(path, generations)
    return generations
