"""A deliberately damaged copy of a Hugging Face model: stands in for a bad quantization in quality tests.

Every floating-point weight tensor gets Gaussian noise of `relative_noise` times its own standard deviation,
so each layer is damaged in proportion to its scale (a fixed absolute noise would wreck the small-valued
norms and barely touch the embeddings). Config and tokenizer files are copied unchanged, so the damaged model
tokenizes prompts exactly like the original and its prompt log-probs can be compared token by token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MARKER = ".kvtune-damage.json"


def damage_model(source: Path, target: Path, relative_noise: float, seed: int) -> Path:
    """Copy `source` to `target` with noisy weights; reuses `target` when it was made with the same recipe."""
    recipe = {"source": str(source), "relative_noise": relative_noise, "seed": seed}
    marker = target / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return target
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    for weights in sorted(source.glob("*.safetensors")):
        tensors = load_file(weights)
        for name, tensor in tensors.items():
            if not tensor.is_floating_point() or tensor.numel() < 2:
                continue
            # In fp32: a bf16 std is coarse, and weight plus noise should round to bf16 once, at the end.
            values = tensor.float()
            noise = torch.randn(values.shape, generator=generator) * values.std() * relative_noise
            tensors[name] = (values + noise).to(tensor.dtype)
        save_file(tensors, target / weights.name, metadata={"format": "pt"})
    marker.write_text(json.dumps(recipe) + "\n")  # last: it means "complete"
    return target
