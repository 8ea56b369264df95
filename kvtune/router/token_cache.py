"""Token ids of a prompt that starts like an earlier one, tokenising only past the part they share.

Tokenising is most of the router's own time (a 600-token prompt takes ~0.6 ms, nearly all of it the
pre-tokenizer's regex), and the traffic a prefix-aware router is for repeats long leading texts: system
prompts, documents, the conversation so far. So the text is cut into chunks of `chunk_chars` characters,
each named by a hash chained to the ones before it, and for each chunk boundary the cache keeps the
tokens before a *safe cut* at or before that boundary: a whitespace character right after a non-space,
where a byte-level BPE tokenizer's pre-tokenizer always splits (GPT-2, Llama 3, Qwen, SmolLM), so the
text tokenised in two parts gives the ids it gives whole. The next prompt with the same leading chunks
reuses those tokens and tokenises only the rest. A tokenizer for which cutting is not exact (checked on
sample texts when the cache is made, e.g. a SentencePiece one that marks the start of a text) is used
uncached: `exact` says which.

The router tokenises in threads (prompt_tokens.TokenizeLanes), so the cache is shared between them: its
table is read and written under a lock, never held while a text is tokenised. A backend that has
`encode_batch` is called through it, for one text: unlike `encode`, it releases the GIL while the Rust
tokenizer works, so a long prompt does not hold the other threads (the router's event loop among them).
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# Texts the cut is checked on: words, punctuation, digits, runs of spaces and newlines, non-ASCII, markup.
_SAMPLES = (
    "You are a careful assistant.  Answer in full sentences, cite the manual (section 4.2), and say when "
    "you are unsure.\n\nThe manual:\n  1. Press the red button -- twice -- then wait 30 s.\n  2. Ça va? "
    "Überprüfen Sie die Anzeige: 12345.678 units, 'ok', \"done\"; x=y+1.\n\t<tag attr='v'>text</tag>   \n"
)


class Encoding(Protocol):
    ids: list[int]
    offsets: list[tuple[int, int]]


class BackendTokenizer(Protocol):
    """A `tokenizers.Tokenizer` (what a Hugging Face fast tokenizer keeps as `backend_tokenizer`); its
    `encode_batch`, when it has one, is preferred (see above)."""

    def encode(self, sequence: str, add_special_tokens: bool = ...) -> Encoding: ...


def encode_releasing(backend: BackendTokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """BACKEND's encoding of TEXT, through `encode_batch` when it has one: the same ids and offsets, with the
    GIL released while they are computed (tokenizers' `encode` keeps it)."""
    batch = getattr(backend, "encode_batch", None)
    if batch is None:
        return backend.encode(text, add_special_tokens=add_special_tokens)
    encoding: Encoding = batch([text], add_special_tokens=add_special_tokens)[0]
    return encoding


@dataclass(frozen=True)
class _Cut:
    ids: list[int]  # the tokenisation this cut was taken from (shared by the cuts of one prompt)
    count: int  # how many of them lie before the cut
    offset: int  # the cut, in characters


def _chunk_hashes(text: str, chunk_chars: int, special: bool) -> list[bytes]:
    """The chained hash of each whole chunk: entry k names text[: (k + 1) * chunk_chars]."""
    digest = b"\x01" if special else b"\x00"
    hashes: list[bytes] = []
    for end in range(chunk_chars, len(text) + 1, chunk_chars):
        digest = hashlib.blake2b(digest + text[end - chunk_chars : end].encode(), digest_size=16).digest()
        hashes.append(digest)
    return hashes


def _cut_before(
    text: str, offsets: Sequence[tuple[int, int]], base: int, boundary: int
) -> tuple[int, int] | None:
    """The last safe cut before BOUNDARY in TEXT[BASE:], whose tokens have OFFSETS (relative to BASE), as
    (character offset, tokens before it): a token boundary at a whitespace character after a non-space.
    None when there is none within the 64 tokens before it (a cut further back is of little use)."""
    # Tokens before `index` end before the boundary.
    first = bisect.bisect_left(offsets, boundary - base, key=lambda offset: offset[1])
    for index in range(first, max(first - 64, 0), -1):
        end = base + offsets[index - 1][1]
        if index >= len(offsets) or end <= base or base + offsets[index][0] < end:
            continue
        if text[end].isspace() and not text[end - 1].isspace():
            return end, index
    return None


class PromptTokenCache:
    """Token ids of texts, reusing the tokens of the longest leading chunks already seen (LRU, at most
    `capacity` chunk boundaries)."""

    def __init__(self, backend: BackendTokenizer, chunk_chars: int = 256, capacity: int = 4096) -> None:
        if chunk_chars <= 0 or capacity <= 0:
            raise ValueError("chunk_chars and capacity must be positive")
        self._backend = backend
        self._chunk_chars = chunk_chars
        self._capacity = capacity
        self._cuts: OrderedDict[bytes, _Cut] = OrderedDict()
        self._lock = threading.Lock()  # the table and counters; never held while tokenising
        self.hits = 0
        self.misses = 0
        self.exact = self._cutting_is_exact()
        if not self.exact:
            log.info("this tokenizer does not tokenise cut texts exactly; prompts are tokenised whole")
        self._cuts.clear()
        self.hits = self.misses = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not self.exact:
            return list(encode_releasing(self._backend, text, add_special_tokens).ids)
        hashes = _chunk_hashes(text, self._chunk_chars, add_special_tokens)
        known, start = self._longest_known(hashes)
        if start is None:
            encoding = encode_releasing(self._backend, text, add_special_tokens)
            ids, base, before = list(encoding.ids), 0, 0
        else:
            encoding = encode_releasing(self._backend, text[start.offset :], False)
            ids, base, before = start.ids[: start.count] + list(encoding.ids), start.offset, start.count
        offsets = encoding.offsets  # a fresh list at each access
        cuts = {}
        for step, digest in enumerate(hashes[known:]):
            cut = _cut_before(text, offsets, base, (known + step + 1) * self._chunk_chars)
            if cut is not None:  # a cut for each new chunk boundary: the last safe one before it
                cuts[digest] = _Cut(ids, before + cut[1], cut[0])
        with self._lock:
            self._cuts.update(cuts)
            while len(self._cuts) > self._capacity:
                self._cuts.popitem(last=False)
        return ids

    def _longest_known(self, hashes: list[bytes]) -> tuple[int, _Cut | None]:
        """How many leading chunks have a cut in the table, and the cut of the last of them (None: no
        chunk is known, the text is tokenised whole); counted as a hit or a miss."""
        with self._lock:
            for known in range(len(hashes), 0, -1):
                start = self._cuts.get(hashes[known - 1])
                if start is not None:
                    self._cuts.move_to_end(hashes[known - 1])
                    self.hits += 1
                    return known, start
            self.misses += 1
            return 0, None

    def _cutting_is_exact(self) -> bool:
        """Whether cut-and-joined ids equal whole ones for this tokenizer, on sample texts that share
        leading chunks, with and without special tokens."""
        self.exact = True
        texts = [_SAMPLES * 3, _SAMPLES * 3 + " A different ending.", _SAMPLES * 2 + "Short.", _SAMPLES * 4]
        for special in (True, False):
            for text in texts:
                whole = list(encode_releasing(self._backend, text, special).ids)
                if self.encode(text, add_special_tokens=special) != whole:
                    return False
        return self.hits > 0
