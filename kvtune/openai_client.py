"""Minimal client for vLLM's OpenAI-compatible API: chat/completions, streamed, with token timing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtune.http_client import OneCredential

Message = dict[str, str]


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What vLLM's --api-key (or VLLM_API_KEY) asks of every /v1 request; nothing without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def client_for(api_key: str | None, timeout: float = 600.0) -> httpx.Client:
    """An HTTP client that sends an engine's API key with every request (harmless on unguarded routes); a
    URL with a user and password beside the key is refused, never sent as Basic auth in its place."""
    return httpx.Client(timeout=timeout, headers=auth_headers(api_key), auth=OneCredential())


@dataclass
class StreamResult:
    """What one streamed request produced and when: TTFT is the first chunk carrying content."""

    text: str = ""
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    e2e: float = 0.0


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of an OpenAI server-sent-event stream, up to `[DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def time_stream(events: Iterable[dict[str, Any]], start: float, clock: Callable[[], float]) -> StreamResult:
    """Time a stream's content chunks against `start` (send time, or intended send time for open loop).

    TTFT is the first chunk that carries content; token counts come from the server's `usage`, never from
    chunk counts (a chunk may hold several tokens).
    """
    result = StreamResult()
    for event in events:
        now = clock() - start
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or choice.get("text")
            if content:
                result.ttft = now if result.ttft is None else result.ttft
                result.token_times.append(now)
                result.text += content
        usage = event.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
    result.e2e = clock() - start
    return result


def stream_body(model: str, max_tokens: int, temperature: float = 0.0) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_chat(
    client: httpx.Client,
    url: str,
    model: str,
    messages: list[Message],
    *,
    max_tokens: int = 32,
    temperature: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> StreamResult:
    """POST a streamed chat completion and time its content chunks from the moment it was sent."""
    body = stream_body(model, max_tokens, temperature) | {"messages": messages} | (extra or {})
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise httpx.HTTPStatusError(
                f"{response.status_code} from {url}: {response.text[:500]}",
                request=response.request,
                response=response,
            )
        return time_stream(sse_events(response.iter_lines()), start, time.perf_counter)


def chat(client: httpx.Client, url: str, model: str, messages: list[Message], *, max_tokens: int = 32) -> str:
    """A greedy, non-streamed chat completion's text."""
    response = client.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0},
    )
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def complete(client: httpx.Client, url: str, model: str, prompt: str, *, max_tokens: int = 1) -> None:
    response = client.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0},
    )
    response.raise_for_status()
