"""Read one streamed OpenAI completion strictly: every answer is timed text or the reason it is not one.

A load test counts what users would see, so an answer the client cannot read as a completion is an error
with a reason, never a request silently dropped (a server streaming JSON arrays once gave "0 requests (0
errors)" over 487 requests sent). vLLM answers `stream: true` with server-sent events: `data: {json}` lines,
one object per chunk, ending with `data: [DONE]`. Anything else raises BadAnswer naming what was wrong: a body
that is not an event stream, a chunk that is not a JSON object, `choices` that is not a list, text that is not
a string, NaN or Infinity anywhere, token counts that are not counts, no `[DONE]`, invalid UTF-8, or more
bytes than any completion needs. Nothing here imports Locust, so it is tested alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvtune.openai_client import StreamResult

# SSE fields (https://html.spec.whatwg.org/multipage/server-sent-events.html); an OpenAI stream uses `data`
# and, from some servers, comments (": ping") and `event`.
_SSE_FIELDS = ("data:", ":", "event:", "id:", "retry:")
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


# One streamed token is one chunk of ~250 bytes from vLLM (id, model, choice, delta); 4 KiB is 16 times
# that, and 64 KiB leaves room for the role and usage chunks and a long model name.
_BYTES_PER_TOKEN = 4 * 1024
_BYTES_BESIDES = 64 * 1024


def answer_cap(max_tokens: int) -> int:
    """The most bytes an answer of at most `max_tokens` tokens may take; past that, a server that never
    stops (reading a stream costs ~20 us a chunk: an unbounded one would cost the client its CPU)."""
    return _BYTES_BESIDES + _BYTES_PER_TOKEN * max_tokens


class BadAnswer(ValueError):
    """The server's answer is not a streamed completion; str() says what was wrong with it."""


def read_completion(
    chunks: Iterable[bytes], start: float, clock: Callable[[], float], *, max_bytes: int
) -> StreamResult:
    """Time the content of a streamed answer against `start`, reading at most `max_bytes` of it.

    TTFT is the first chunk that carries text; token counts come from the server's `usage`, never from
    chunk counts (a chunk may hold several tokens). Returns at `data: [DONE]`; BadAnswer otherwise.
    """
    result = StreamResult()
    pieces: list[str] = []  # joined once at the end: adding to a string each chunk is quadratic
    seen_data = False
    for line in _lines(chunks, max_bytes):
        if not line:
            continue
        if not line.startswith(_SSE_FIELDS):
            kind = "an event stream" if seen_data else "a server-sent-event stream"
            raise BadAnswer(f"not {kind}: a line reads {shown_text(line, 80)!r}")
        if not line.startswith("data:"):
            continue
        seen_data = True
        payload = line.removeprefix("data:").strip()
        if payload == "[DONE]":
            if result.ttft is None:
                raise BadAnswer("the stream ended without any text")
            result.text = "".join(pieces)
            result.e2e = clock() - start
            return result
        _take(_chunk(payload), clock() - start, result, pieces)
    if not seen_data:
        raise BadAnswer("the body held no `data:` event: not a server-sent-event stream")
    raise BadAnswer("the stream ended before `data: [DONE]`")


def shown_text(text: str, limit: int = 300) -> str:
    """`text` as one printable line of at most `limit` characters (server text can hold escapes, newlines)."""
    flat = " ".join(_UNPRINTABLE.sub(" ", text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _lines(chunks: Iterable[bytes], max_bytes: int) -> Iterator[str]:
    """The body's lines as text; a line without an end is held in a buffer the size cap also bounds."""
    buffer = bytearray()
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise BadAnswer(
                f"the answer ran past {max_bytes // 1024:,} KiB, more than its max_tokens can take"
            )
        buffer += chunk
        end = buffer.rfind(b"\n")
        if end < 0:
            continue
        complete, buffer = bytes(buffer[:end]), buffer[end + 1 :]
        for line in complete.split(b"\n"):
            yield _text(line.removesuffix(b"\r"))
    if buffer:
        yield _text(bytes(buffer))


def _text(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        raise BadAnswer("the stream is not UTF-8 text") from None


def _refuse_constant(constant: str) -> Any:
    raise BadAnswer(f"a chunk holds {constant}, which is not a JSON number")


def _chunk(payload: str) -> dict[str, Any]:
    try:
        event = json.loads(payload, parse_constant=_refuse_constant)
    except BadAnswer:
        raise
    except (ValueError, RecursionError):
        raise BadAnswer(f"a chunk is not JSON: {shown_text(payload, 80)!r}") from None
    if not isinstance(event, dict):
        raise BadAnswer(f"a chunk is a JSON {_kind(event)}, where an object belongs")
    # vLLM reports a failure inside a stream as {"error": {"message": ...}}, older versions as
    # {"object": "error", "message": ...}.
    if "error" in event or event.get("object") == "error":
        error = event.get("error", event)
        message = error.get("message") if isinstance(error, dict) else error
        raise BadAnswer(f"the server reported an error mid-stream: {shown_text(str(message))}")
    return event


def _take(event: dict[str, Any], now: float, result: StreamResult, pieces: list[str]) -> None:
    """Add one chunk's timing and usage to `result` and its text to `pieces`, checking their shapes."""
    choices = event.get("choices")
    if choices is None:
        choices = []
    if not isinstance(choices, list):
        raise BadAnswer(f"a chunk's `choices` is a JSON {_kind(choices)}, not an array")
    for choice in choices:
        if not isinstance(choice, dict):
            raise BadAnswer(f"a chunk's choice is a JSON {_kind(choice)}, not an object")
        delta = choice.get("delta")
        if delta is not None and not isinstance(delta, dict):
            raise BadAnswer(f"a choice's `delta` is a JSON {_kind(delta)}, not an object")
        content = _string(delta or {}, "delta.content", "content")
        text = content or _string(choice, "text", "text")
        if text:
            result.ttft = now if result.ttft is None else result.ttft
            result.token_times.append(now)
            pieces.append(text)
    usage = event.get("usage")
    if usage is None:
        return
    if not isinstance(usage, dict):
        raise BadAnswer(f"a chunk's `usage` is a JSON {_kind(usage)}, not an object")
    result.prompt_tokens = _count(usage, "prompt_tokens")
    result.completion_tokens = _count(usage, "completion_tokens")
    details = usage.get("prompt_tokens_details")
    if details is not None and not isinstance(details, dict):
        raise BadAnswer(f"`usage.prompt_tokens_details` is a JSON {_kind(details)}, not an object")
    result.cached_tokens = _count(details or {}, "cached_tokens")


def _string(holder: dict[str, Any], shown: str, key: str) -> str | None:
    value = holder.get(key)
    if value is not None and not isinstance(value, str):
        raise BadAnswer(f"a choice's `{shown}` is a JSON {_kind(value)}, not a string")
    return value


def _count(holder: dict[str, Any], key: str) -> int | None:
    value = holder.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadAnswer(f"`usage.{key}` is {shown_text(json.dumps(value), 40)}, not a token count")
    return value


def _kind(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
