"""A request's prompt as the engines will tokenise it, so the router's block hashes name the same blocks.

Completions: the prompt string with the tokenizer's special tokens (vLLM adds them by default); chat: the
model's chat template with the generation prompt, as vLLM's chat endpoint renders it. Token-id prompts are
taken as they are.
"""

from __future__ import annotations

from typing import Any, Protocol


class ChatTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


def prompt_tokens(tokenizer: ChatTokenizer, body: dict[str, Any], endpoint: str) -> list[int]:
    """The prompt's token ids; ValueError or TypeError (refused as a bad prompt) when it has none."""
    if endpoint == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list of {role, content} objects")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message:
                raise ValueError(f"messages[{index}] must be an object with a 'role'")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        # transformers 5 returns a BatchEncoding for a single conversation; 4.x a list of ids.
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        return [int(token) for token in ids]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(token, int) for token in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        return tokenizer.encode(prompt[0])
    raise TypeError("'prompt' must be a string, one string in a list, or a list of token ids")
