"""Minimal client for vLLM's OpenAI-compatible API: chat/completions, streamed, with token timing."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

Message = dict[str, str]


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


def _sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)


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
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | (extra or {})
    result = StreamResult()
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise httpx.HTTPStatusError(
                f"{response.status_code} from {url}: {response.text[:500]}",
                request=response.request,
                response=response,
            )
        for event in _sse_events(response):
            now = time.perf_counter() - start
            for choice in event.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
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
    result.e2e = time.perf_counter() - start
    return result


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
