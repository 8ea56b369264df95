"""How many tokens an engine's answer generated, read from the answer the router passes back.

A whole answer carries vLLM's `usage.completion_tokens`. A stream carries it only when the client asked
(`stream_options.include_usage`, or an engine started with `--enable-force-include-usage`); otherwise each
event that brings text counts as one token: vLLM 0.32 sends one event per generated token at its default
`--stream-interval 1` and skips steps that add no text (a partial UTF-8 character, a tool-call control
token), so the count is the tokens that carried text, a floor under the real one. The router's own
tokenizer counts a whole answer that has no usage (never vLLM's case; an answer the router cannot read
counts 0). Nothing here keeps the answer's text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

# An SSE line longer than this is not one of vLLM's events (a token's event is ~200 bytes): the count stops.
MAX_EVENT_BYTES = 1 << 20
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


def _usage_tokens(answer: Any) -> int | None:
    usage = answer.get("usage") if isinstance(answer, dict) else None
    value = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _choices(answer: Any) -> list[dict[str, Any]]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return [choice for choice in choices if isinstance(choice, dict)] if isinstance(choices, list) else []


def _text_of(part: Any) -> str:
    """The generated text in a choice's `message` or `delta` (chat) or in the choice itself (completions)."""
    if not isinstance(part, dict):
        return ""
    pieces = [part.get("text")] + [part.get(name) for name in _TEXT_FIELDS]
    return "".join(piece if isinstance(piece, str) else json.dumps(piece) for piece in pieces if piece)


def whole_answer_tokens(body: bytes, count_text: Callable[[str], int]) -> int:
    """Output tokens of a non-streamed answer: its usage, else its choices' text counted by COUNT_TEXT."""
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        return 0
    used = _usage_tokens(answer)
    if used is not None:
        return used
    texts = [_text_of(choice.get("message")) or _text_of(choice) for choice in _choices(answer)]
    return sum(count_text(text) for text in texts if text)


class StreamTokens:
    """Counts the tokens of an SSE stream as its bytes pass through, cut anywhere between reads."""

    def __init__(self) -> None:
        self._partial = b""
        self._events = 0
        self._usage: int | None = None
        self._lost = False  # an event too long to be vLLM's: stop reading the rest

    @property
    def tokens(self) -> int:
        return self._usage if self._usage is not None else self._events

    def feed(self, chunk: bytes) -> None:
        if self._lost:
            return
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > MAX_EVENT_BYTES:
            self._lost, self._partial = True, b""
            return
        for line in lines:
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, payload: bytes) -> None:
        if not payload or payload == b"[DONE]":
            return
        try:
            event = json.loads(payload)
        except (ValueError, RecursionError):
            return
        used = _usage_tokens(event)
        if used is not None:
            self._usage = used
        self._events += sum(
            1 for choice in _choices(event) if _text_of(choice.get("delta")) or _text_of(choice)
        )
