"""How few tokens a text can have, from its bytes and the tokenizer's own description (tokenizer.json).

When no token stands for more than L bytes, a text whose tokens spell S of its bytes has at least S / L
tokens, so a prompt that spells max_model_len * L bytes or more is refused without being tokenised
(tokenising costs ~1 ms per 1,000 tokens, on the router's event loop; SmolLM2's longest token is 81 bytes).

S is every byte of the text unless the tokenizer loses some. A byte-level BPE loses the bytes its
vocabulary has no piece for: SmolLM2's drops six ASCII control characters (\\x04, \\x06, \\x13, \\x14, \\x16,
\\x1d) and the lead bytes \\xf1 and \\xf2 of 4-byte characters, so those are counted out. A tokenizer that may
lose more gets no bound (None), and its prompts are tokenised to be measured: a normalizer that drops or
folds characters (lowercase, strip, NFKC), a pre-tokenizer that drops whitespace, a model that spells what
it does not know with one unknown token for any length (WordPiece, fused unknowns), a special token that
swallows the spaces beside it. NFC may compose up to three characters' bytes into one character's (Hangul
jamo L+V+T, 9 bytes, into one syllable of 3), so an NFC tokenizer's L is three times its longest token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from itertools import chain
from typing import Any

NFC_SHRINK = 3
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}
)
# Bytes no UTF-8 text holds: a vocabulary needs no piece for them.
_NEVER_IN_UTF8 = frozenset({0xC0, 0xC1, *range(0xF5, 0x100)})
# Of the bytes a character has beyond its first, the share a missing lead byte can be: one in one (2-byte
# characters, lead 0xC2-0xDF), one in two (3-byte, 0xE0-0xEF), one in three (4-byte, 0xF0-0xF4).
_LEAD_SHARE = {**dict.fromkeys(range(0xC2, 0xE0), 1.0), **dict.fromkeys(range(0xE0, 0xF0), 0.5),
               **dict.fromkeys(range(0xF0, 0xF5), 1 / 3)}  # fmt: skip


@dataclass(frozen=True)
class TokenBytes:
    """What a tokenizer's tokens spell of a text: at most `longest` bytes each, and every byte of it but
    the ASCII characters in `unspelled_ascii` and, of the bytes its characters have beyond their first,
    a share `unspelled_extra` at most (missing lead or continuation bytes)."""

    longest: int
    unspelled_ascii: str = ""
    unspelled_extra: float = 0.0

    def spelled_bytes(self, text: str) -> int:
        """At least how many of TEXT's UTF-8 bytes its tokens spell."""
        size = len(text.encode())
        lost = sum(text.count(char) for char in self.unspelled_ascii)
        lost += math.ceil((size - len(text)) * self.unspelled_extra)
        return max(size - lost, 0)


def token_bytes_of(tokenizer: object) -> TokenBytes | None:
    """The bound for a Hugging Face fast tokenizer (or its `backend_tokenizer`); None without one."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        return None
    try:
        spec = json.loads(to_str())
    except (TypeError, ValueError):
        return None
    return bound_of(spec) if isinstance(spec, dict) else None


def bound_of(spec: dict[str, Any]) -> TokenBytes | None:
    """The bound for a `tokenizer.json` document."""
    model = spec.get("model") or {}
    pre = _parts(spec.get("pre_tokenizer"))
    byte_level = any(part.get("type") == "ByteLevel" for part in pre)
    shrink = _normalizer_shrink(spec.get("normalizer"))
    added = spec.get("added_tokens") or []
    vocab = model.get("vocab") or {}
    # Unigram keeps [piece, score] pairs; BPE a piece -> id map.
    pieces = (
        [str(entry[0]) for entry in vocab] if isinstance(vocab, list) else [str(piece) for piece in vocab]
    )
    if (
        shrink is None
        or not all(_keeps_bytes(part) for part in pre)
        or any(token.get("lstrip") or token.get("rstrip") for token in added)
    ):
        return None
    if model.get("byte_fallback") or (
        model.get("type") == "BPE" and not byte_level and _unknowns_one_each(model)
    ):
        missing: frozenset[int] = frozenset()
    elif model.get("type") == "BPE" and byte_level:
        # A byte without a piece is dropped, or spelled as one unknown token each, or (fused) as one for
        # a whole run of them.
        missing = frozenset() if _unknowns_one_each(model) else _bytes_without_piece(set(pieces))
        if missing and (shrink != 1 or model.get("unk_token") is not None):
            return None  # what a normalizer changed cannot be told from what was dropped; fused runs
    else:
        return None
    # A byte-level piece spells each byte with one character; other pieces are text (UTF-8 length is an
    # upper bound: SentencePiece's "▁" is 3 bytes for one space, a "<0x41>" byte piece 6 for one byte).
    lengths = chain(
        (len(piece) if byte_level else len(piece.encode()) for piece in pieces),
        (len(str(token.get("content", "")).encode()) for token in added),
    )
    longest = max(lengths, default=0)
    if longest <= 0:
        return None
    unspelled_extra = max((_LEAD_SHARE.get(byte, 0.0) for byte in missing), default=0.0)
    if any(0x80 <= byte < 0xC0 for byte in missing):  # continuation bytes: all a character's extra
        unspelled_extra += 1.0
    return TokenBytes(
        longest=math.ceil(longest * shrink),
        unspelled_ascii="".join(chr(byte) for byte in sorted(missing) if byte < 0x80),
        unspelled_extra=min(unspelled_extra, 2.0),
    )


def _bytes_without_piece(pieces: set[str]) -> frozenset[int]:
    """The bytes UTF-8 text can hold that a byte-level vocabulary has no one-byte piece for."""
    return frozenset(
        byte
        for byte, char in _byte_level_chars().items()
        if char not in pieces and byte not in _NEVER_IN_UTF8
    )


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level piece."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in chars]
    chars |= {byte: chr(256 + index) for index, byte in enumerate(others)}
    return chars


def _unknowns_one_each(model: dict[str, Any]) -> bool:
    """A BPE that spells an unknown character as one unknown token each (never one for a run of them)."""
    return model.get("unk_token") is not None and not model.get("fuse_unk")


def _parts(component: Any) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer as the list of its steps (a Sequence's, or itself)."""
    if not isinstance(component, dict):
        return []
    if component.get("type") == "Sequence":
        steps = component.get("pretokenizers") or component.get("normalizers") or []
        return [part for step in steps for part in _parts(step)]
    return [component]


def _keeps_bytes(pre_tokenizer: dict[str, Any]) -> bool:
    # Split and Punctuation drop what they split on when told to ("Removed").
    removes = str(pre_tokenizer.get("behavior", "")).lower() == "removed"
    return pre_tokenizer.get("type") in _KEEPING_PRE_TOKENIZERS and not removes


def _normalizer_shrink(normalizer: Any) -> float | None:
    """How many times fewer bytes the normalized text can have than the prompt; None when unbounded."""
    if normalizer is None:
        return 1.0
    shrink = 1.0
    for step in _parts(normalizer):
        kind = step.get("type")
        if kind in ("NFC", "NFD"):
            shrink *= NFC_SHRINK
        elif kind == "Replace":
            pattern, content = step.get("pattern") or {}, str(step.get("content", ""))
            if "String" not in pattern or not content:
                return None  # a regex, or a deletion: any length may go
            shrink *= max(1.0, len(str(pattern["String"]).encode()) / len(content.encode()))
        elif kind != "Prepend":
            return None
    return shrink
