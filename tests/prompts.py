"""Deterministic long prompts for cache tests: distinct per seed, so tests never share cached prefixes."""

from __future__ import annotations

import random

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
