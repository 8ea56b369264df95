"""A request's prompt as the engines will tokenise it, so the router's block hashes name the same blocks.

Completions: the prompt string with the tokenizer's special tokens (vLLM adds them by default); chat: the
model's chat template with the generation prompt, as vLLM's chat endpoint renders it. Token-id prompts are
taken as they are. Texts go through a PromptTokenCache, so a prompt that starts like an earlier one is
tokenised only past the shared part.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvtune.router.token_cache import PromptTokenCache


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def _ids(rendered: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding for a single conversation; 4.x a list of ids.
    ids = rendered["input_ids"] if not isinstance(rendered, list) else rendered
    return [int(token) for token in ids]


class PromptEncoder:
    """The served model's tokenizer as the router uses it: prompts and chats to token ids, cached."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self._tokenizer = tokenizer
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._cache is not None:
            return self._cache.encode(text, add_special_tokens)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if self._chat_as_text:
            return self._render_then_encode(messages)
        return self._template_ids(messages)

    def _render_then_encode(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens itself, as vLLM's chat endpoint relies on.
        return self.encode(str(text), add_special_tokens=False)

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
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return encoder.encode(prompt[0])
    raise TypeError("'prompt' must be a string, one string in a list, or a list of token ids")
