"""What the router's OpenAI front is set up with: the model it serves, its limits, keys and timeouts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (body, endpoint) -> prompt token ids; ValueError, TypeError or KeyError for a prompt that cannot be
# read, PromptTooLong for one refused before tokenising.
Tokenize = Callable[[dict[str, Any], str], list[int]]


@dataclass(frozen=True)
class ProxySettings:
    served_model_name: str
    block_size: int
    max_model_len: int | None = None
    # Where the model (and its tokenizer) is read from, as vLLM's model list shows it (`root`): a client that
    # tokenises (a Locust workload) finds the tokenizer through the router as it would through an engine.
    model_root: str | None = None
    api_key: str | None = None  # what clients must send to the router
    engine_api_key: str | None = None  # what the router sends the engines
    session_header: str = "x-session-id"
    connect_timeout_s: float = 2.0
    # A streamed answer: the longest silence between two reads (a long generation is legitimate).
    read_timeout_s: float = 300.0
    # A non-streamed answer, sent to its last byte: vLLM sends it whole once the generation is done.
    answer_deadline_s: float = 300.0
    max_answer_bytes: int = 256 << 20
    # The largest request body read; None: sized from max_model_len (request_limits.py).
    max_body_bytes: int | None = None
