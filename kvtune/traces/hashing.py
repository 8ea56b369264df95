"""Chained block ids of token-id prompts, keyed so that a trace can be shared without the traffic's text.

Each block of `block_size` tokens (the last, partial one too, as the trace format counts them) gets the id
BLAKE2b(key, parent id, the block's token ids) cut to 63 bits, so an id stands for its whole prefix and
equal prefixes get equal ids within one capture. The key is random, made once per capture or conversion,
held in memory only and never written, logged or put on a command line: without it an id cannot be
recomputed from a guessed prompt, so even a block of a few common tokens cannot be found by trying every
candidate (an unkeyed hash of short content can). Two captures (two keys) share no ids.

What a trace made this way reveals: when each request arrived, its prompt and output lengths in tokens,
and which requests share which prefixes, block by block (a system prompt, a document, a conversation's
history). What it does not: the text, the token ids, or whether two captures saw the same prompts.

Speed, measured on this project's 2-core machine beside other work: a 2,000-token prompt in ~0.1 ms at 32
tokens a block (63 ids), ~0.05 ms at 128 (16 ids), a twentieth of tokenising it; the router hashes each
captured request once, as it ends.
"""

from __future__ import annotations

import hashlib
import secrets
import sys
from array import array
from collections.abc import Sequence

# BLAKE2b takes keys up to 64 bytes; 32 random bytes put guessing the key beyond reach.
KEY_BYTES = 32
# Ids are 63-bit non-negative integers (the format's 0..2**63-1). With 20 million distinct blocks (the
# format's bound) the chance that two collide is about n^2 / 2^64 = 2e-5.
ID_BITS = 63
# The first block's parent: 8 bytes no id has (ids stay below 2**63).
_ROOT = b"\xff" * 8
# Domain separation: these digests are trace ids and nothing else kvtune hashes.
_PERSON = b"kvtune-trace-ids"


def new_key() -> bytes:
    """A fresh random key for one capture or conversion (never to be written anywhere)."""
    return secrets.token_bytes(KEY_BYTES)


class BlockHasher:
    """The chained, keyed ids of prompts at one block size; its repr never shows the key."""

    def __init__(self, key: bytes, block_size: int) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a trace key is {KEY_BYTES} bytes, not {len(key)}")
        if block_size < 1:
            raise ValueError(f"block_size: {block_size} is not a positive number of tokens")
        # The key's own compression done once: each block starts from a copy of this state.
        self._keyed = hashlib.blake2b(key=key, digest_size=8, person=_PERSON)
        self.block_size = block_size

    def __repr__(self) -> str:
        return f"BlockHasher(block_size={self.block_size}, key=<hidden>)"

    def ids(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """One id per block of TOKENS, the last partial block included: ceil(len / block_size) ids.
        OverflowError for a token id outside 0..2**32-1 (no vocabulary is that large)."""
        packed = array("I", tokens)  # C unsigned int: 4 bytes wherever kvtune runs
        if sys.byteorder != "little":
            packed.byteswap()
        data = memoryview(packed.tobytes())
        step = self.block_size * packed.itemsize
        parent, chain = _ROOT, []
        for start in range(0, len(data), step):
            digest = self._keyed.copy()
            digest.update(parent)
            digest.update(data[start : start + step])
            value = int.from_bytes(digest.digest(), "little") >> (64 - ID_BITS)
            chain.append(value)
            parent = value.to_bytes(8, "little")
        return tuple(chain)
