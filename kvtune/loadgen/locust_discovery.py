"""The model a Locust run sends to: read from the server's OpenAI model list, with the API key when set, and
the engine's block size from its metrics.

Bad input (an unreachable host, a server that is not vLLM, a model it does not serve) ends the Locust
process with a one-line reason and exit code 2, before any user starts.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import httpx

from kvtune import http_client, metrics
from kvtune.http_client import shown_url
from kvtune.loadgen.completions import shown_text
from kvtune.loadgen.workload_args import API_KEY_ENV

# The model list is a few KB from a live server.
DISCOVERY_DEADLINE_S = 10.0


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer KEY` when KVTUNE_API_KEY is set (vLLM's --api-key guards /v1 routes)."""
    key = os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class ServedModel:
    name: str
    root: str
    max_model_len: int | None = None  # vLLM lists it with each model
    block_size: int | None = None  # the engine's KV block size, when its /metrics says


def discover_model(host: str, wanted: str) -> ServedModel:
    """The model the server serves (the one named, or its first); exits with a clear message if not."""
    url = f"{host.rstrip('/')}/v1/models"
    shown = shown_url(url)
    try:
        with http_client.new_client(auth_headers()) as client:
            response = http_client.get(client, url, deadline_s=DISCOVERY_DEADLINE_S)
    except httpx.HTTPError as exc:
        reason = shown_text(f"{exc.__class__.__name__}: {exc}", 200)
        fail(f"cannot reach {shown_url(host)} ({reason}); start the engine or fix --host")
    if response.status_code in (401, 403):
        fail(f"{shown} answered HTTP {response.status_code}: the server needs an API key; set {API_KEY_ENV}")
    models = _served_models(response) if response.status_code == 200 else None
    if models is None:
        kind = shown_text(response.headers.get("content-type", "no content type"), 60)
        fail(
            f"{shown} answered HTTP {response.status_code} ({kind}), not a model list: "
            f"{shown_url(host)} is not an OpenAI-compatible vLLM server; fix --host"
        )
    if not models:
        fail(f"{shown_url(host)} serves no model")
    name = wanted or next(iter(models))
    if name not in models:
        listed = shown_text(", ".join(models), 200)
        fail(f"model {name!r} is not served by {shown_url(host)}; it serves: {listed}. Fix --model")
    return models[name]


def engine_block_size(host: str) -> int | None:
    """The engine's KV block size (`vllm:cache_config_info`'s block_size); None when its /metrics cannot be
    read or does not say."""
    try:
        with http_client.new_client(auth_headers()) as client:
            response = http_client.get(client, f"{host.rstrip('/')}/metrics", deadline_s=DISCOVERY_DEADLINE_S)
        response.raise_for_status()
        labels = metrics.cache_config(metrics.parse(response.content.decode("utf-8")))
        return metrics.label_count(labels, "block_size") or None
    except (httpx.HTTPError, ValueError):  # UnicodeDecodeError and the parser's errors are ValueErrors
        return None


def _served_models(response: httpx.Response) -> dict[str, ServedModel] | None:
    """Model id -> the model (its root names its tokenizer) of an OpenAI model list; None for any other
    answer."""
    try:
        listed = http_client.strict_json(response)
    except http_client.NotJson:
        return None
    entries = listed.get("data") if isinstance(listed, dict) else None
    if not isinstance(entries, list):
        return None
    models: dict[str, ServedModel] = {}
    for entry in entries:
        model_id = entry.get("id") if isinstance(entry, dict) else None
        if not isinstance(model_id, str) or not model_id:
            return None
        root = entry.get("root")
        length = entry.get("max_model_len")
        models[model_id] = ServedModel(
            model_id,
            root if isinstance(root, str) and root else model_id,
            length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None,
        )
    return models


def fail(message: str) -> NoReturn:
    """Bad input: say why on stderr and leave with exit code 2, without a traceback."""
    sys.stderr.write(f"kvtune: {message}\n")
    sys.stderr.flush()
    os._exit(2)
