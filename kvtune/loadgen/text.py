"""Prompt text sized in the served model's tokens, deterministic per seed."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Protocol

_WORDS = (
    "the of and to in is was for on that with as by at from his her an which this be are were had has "
    "river mountain engine harbor lantern orchard copper meadow signal archive beacon canyon delta ember "
    "falcon glacier horizon island jasmine kernel lagoon marble nebula oasis prism quartz raven summit "
    "timber valley willow zenith anchor bridge cobalt dune market letter garden winter summer window "
    "history science music ocean forest city village road station doctor teacher report result system"
).split()


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def load_tokenizer(name_or_path: str, revision: str | None = None) -> Tokenizer:
    """A Hugging Face tokenizer from a local model folder or a hub id, at REVISION when given (the engine's
    pinned one); imported lazily: it is slow."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(name_or_path, revision=revision)
    return tokenizer  # type: ignore[no-any-return]


class _FastTokenizer:
    """A model's tokenizer.json through Hugging Face's `tokenizers` alone, as a transformers fast tokenizer
    encodes and decodes with it."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text: str = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return text


def load_text_tokenizer(name_or_path: str, revision: str | None = None) -> Tokenizer:
    """The tokenizer prompts are sized with: a local model folder's tokenizer.json read by `tokenizers`
    (~0.1 s), else transformers' (a hub id, a model without tokenizer.json).

    Every load step starts its own Locust process, and importing transformers there costs ~5 s of CPU
    before the first request, once per step."""
    path = Path(name_or_path) / "tokenizer.json"
    if not path.is_file():
        return load_tokenizer(name_or_path, revision)
    from tokenizers import Tokenizer as Backend

    return _FastTokenizer(Backend.from_file(str(path)))


class TextMaker:
    """Makes text of an exact token count, and counts tokens, with the served model's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def token_ids(self, n_tokens: int, seed: str | int) -> list[int]:
        """`n_tokens` token ids of word salad seeded by `seed` (same seed, same ids)."""
        if n_tokens <= 0:
            return []
        rng = random.Random(str(seed))
        ids: list[int] = []
        while len(ids) < n_tokens:
            words = " ".join(rng.choice(_WORDS) for _ in range(n_tokens))
            ids += self.tokenizer.encode(f" {words}.", add_special_tokens=False)
        return ids[:n_tokens]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text(self, n_tokens: int, seed: str | int) -> str:
        return self.decode(self.token_ids(n_tokens, seed))


def vocab_size(tokenizer: Tokenizer) -> int | None:
    """Token ids the tokenizer knows (added tokens included); None when it cannot say."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_vocab_size"):
        return int(backend.get_vocab_size(with_added_tokens=True))
    try:
        return len(tokenizer)  # type: ignore[arg-type]  # transformers' tokenizers know their length
    except TypeError:
        return None
