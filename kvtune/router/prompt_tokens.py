"""A request's prompt as the engines will tokenise it, so the router's block hashes name the same blocks.

Completions: the prompt string with the tokenizer's special tokens (vLLM adds them by default); chat: the
model's chat template with the generation prompt, as vLLM's chat endpoint renders it. Token-id prompts are
taken as they are. Texts go through a PromptTokenCache, so a prompt that starts like an earlier one is
tokenised only past the shared part. A text whose length in bytes already proves it longer than
max_model_len tokens is refused before it is tokenised (token_bytes.py says when that proof holds).

The router tokenises off its event loop, in TokenizeLanes: a prompt of a whole context's tokens takes
seconds (~1 ms per 1,000 tokens on these hosts) and, on the loop, would hold every other request of the
worker (their reads, their streamed answers, /health) for as long.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import jinja2

from kvtune.router.prefix_index import MAX_TOKEN_ID
from kvtune.router.proxy_settings import Tokenize
from kvtune.router.token_bytes import token_bytes_of
from kvtune.router.token_cache import PromptTokenCache


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def _ids(rendered: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding for a single conversation; 4.x a list of ids.
    ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    return [int(token) for token in ids]


class PromptTooLong(Exception):
    """A prompt whose bytes alone prove it has max_model_len tokens or more."""

    def __init__(self, spelled_bytes: int, max_model_len: int, longest: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has at "
            f"least {math.ceil(spelled_bytes / longest)} tokens ({spelled_bytes:,} bytes, and no token of "
            f"this model stands for more than {longest} bytes)."
        )


class PromptEncoder:
    """The served model's tokenizer as the router uses it: prompts and chats to token ids, cached, and
    prompts of MAX_MODEL_LEN tokens or more refused unread when their size proves it (PromptTooLong)."""

    def __init__(self, tokenizer: ChatTokenizer, max_model_len: int | None = None) -> None:
        self._tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.token_bytes = token_bytes_of(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer's own
        # The cache tokenises whole itself when cutting is not exact for this tokenizer.
        self._cache = PromptTokenCache(backend) if backend is not None else None
        # Chats are rendered to text, then tokenised as text (cached) when that gives the template's own
        # ids; checked once on a sample conversation.
        sample = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
        self._chat_as_text = self._render_then_encode(sample) == self._template_ids(sample)

    @property
    def cached(self) -> bool:
        return self._cache is not None and self._cache.exact

    def check_size(self, text: str) -> None:
        """PromptTooLong when TEXT has too many bytes to be under max_model_len tokens."""
        if self.token_bytes is None or self.max_model_len is None:
            return
        bound = self.max_model_len * self.token_bytes.longest
        if len(text) * 4 < bound:  # a character is at most 4 bytes: no need to count them
            return
        spelled = self.token_bytes.spelled_bytes(text)
        if spelled >= bound:
            raise PromptTooLong(spelled, self.max_model_len, self.token_bytes.longest)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_size(text)
        if self._cache is not None:
            return self._cache.encode(text, add_special_tokens)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            text = self._render(messages)  # cheap beside tokenising; measured before it
            if self._chat_as_text:
                # The template writes the special tokens itself, as vLLM's chat endpoint relies on.
                return self.encode(text, add_special_tokens=False)
            self.check_size(text)
            return self._template_ids(messages)
        except jinja2.TemplateError as exc:  # the template's own refusal (roles must alternate, ...)
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return str(self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def _render_then_encode(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self._render(messages), add_special_tokens=False)

    def _template_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return _ids(self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def prompt_tokens(encoder: PromptEncoder, body: dict[str, Any], endpoint: str) -> list[int]:
    """The prompt's token ids; ValueError or TypeError (refused as a bad prompt) when it has none."""
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{index}] must be an object with a 'role'")
        return encoder.chat(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return encoder.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(token) is int for token in prompt):
        if min(prompt) < 0 or max(prompt) > MAX_TOKEN_ID:
            raise ValueError(f"'prompt' token ids must be 0 to {MAX_TOKEN_ID}")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return encoder.encode(prompt[0])
    raise TypeError("'prompt' must be a string, one string in a list, or a list of token ids")


# A body past this is a long prompt (~16,000 tokens of English): tokenised in the long lane.
LONG_PROMPT_BYTES = 64 * 1024
# Threads of each lane. The Rust tokenizer releases the GIL (token_cache.encode_releasing), so prompts in
# different threads are tokenised at once; a bounded pool makes a burst of long prompts queue, in their
# own lane, instead of starting a thread each.
LANE_THREADS = 2


class TokenizeLanes:
    """Where the router tokenises prompts: in threads, off its event loop, long prompts in a lane of
    their own so that however many arrive, a short prompt never waits behind them."""

    def __init__(self, threads: int = LANE_THREADS, long_bytes: int = LONG_PROMPT_BYTES) -> None:
        self.long_bytes = long_bytes
        self._short = ThreadPoolExecutor(threads, thread_name_prefix="router-tokenize")
        self._long = ThreadPoolExecutor(threads, thread_name_prefix="router-tokenize-long")

    async def tokenize(self, tokenize: Tokenize, body: dict[str, Any], endpoint: str, size: int) -> list[int]:
        """TOKENIZE(BODY, ENDPOINT) in the lane of a request of SIZE bytes; its exceptions are raised here."""
        lane = self._long if size > self.long_bytes else self._short
        return await asyncio.get_running_loop().run_in_executor(lane, tokenize, body, endpoint)

    def close(self) -> None:
        """Queued prompts dropped; one being tokenised finishes in its thread (it is bounded by the
        context's length), its answer unread."""
        for lane in (self._short, self._long):
            lane.shutdown(wait=False, cancel_futures=True)
