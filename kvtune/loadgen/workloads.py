"""The workloads where the KV cache decides latency, as request generators sized in tokens.

Each workload says, for every request, how many of its prompt tokens a prefix cache could reuse
(`shared_tokens`): the run reports that target next to the hit rate the engine achieved.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvtune.config_errors import ConfigError
from kvtune.documents import open_regular
from kvtune.loadgen.text import TextMaker
from kvtune.loadgen.workload_args import DEFAULT_MAX_TOKENS, WorkloadError, validate_workload_args

Message = dict[str, str]
# WorkloadError lives with the flag definitions; it is re-exported here, where workloads raise it.
__all__ = [
    "Conversation",
    "LLMRequest",
    "LongDocQA",
    "Message",
    "MultiTurn",
    "Replay",
    "SharedPrefix",
    "Workload",
    "WorkloadError",
    "load_replay",
    "replay_record",
    "shared_prefix_tokens",
]


@dataclass(frozen=True)
class LLMRequest:
    """One request: chat messages or a completion prompt (text or token ids), with its designed token
    accounting."""

    messages: list[Message] | None = None
    prompt: str | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    prompt_tokens: int = 0  # designed prompt size (without the chat template's own tokens)
    shared_tokens: int = 0  # of which a prefix cache could reuse this many
    # A completion prompt as token ids: a hash-block trace's blocks, which no text would tokenize back to.
    prompt_token_ids: list[int] | None = None
    ignore_eos: bool = False  # generate max_tokens whatever the model says: a trace's output lengths
    trace_index: int | None = None  # the request's line in a trace (0-based)
    cut_prompt_tokens: int = 0  # trimmed to fit the engine's max_model_len
    cut_output_tokens: int = 0


@dataclass
class Conversation:
    """A user's multi-turn chat history; other workloads ignore it."""

    messages: list[Message] = field(default_factory=list)
    tokens: int = 0
    turn: int = 0


class Workload(Protocol):
    name: str

    def next_request(self, index: int, conversation: Conversation) -> LLMRequest: ...

    def describe(self) -> dict[str, Any]: ...


def _check(workload: str, **sizes: float | None) -> None:
    """Workloads built from Python get the same checks as their flags (kvtune.loadgen.workload_args)."""
    validate_workload_args(workload, {k.replace("_", "-"): v for k, v in sizes.items() if v is not None})


def shared_prefix_tokens(system_tokens: int, user_tokens: int, reuse: float | None) -> int:
    """Prompt tokens every shared_prefix request shares: `reuse` of the prompt, default the system prompt."""
    total = system_tokens + user_tokens
    return round((reuse if reuse is not None else system_tokens / total) * total)


@dataclass
class SharedPrefix:
    """A long fixed system prompt plus a varying user message.

    `reuse` is the target share of prompt tokens that repeat across requests: the first
    reuse x (system + user) tokens are the same for every request, the rest are unique. The default
    share makes exactly the system prompt shared. Sizes and defaults: workload_args.WORKLOAD_ARGS.
    """

    maker: TextMaker
    system_tokens: int
    user_tokens: int
    reuse: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = 0
    name: str = "shared_prefix"

    def __post_init__(self) -> None:
        _check(
            self.name, system_tokens=self.system_tokens, user_tokens=self.user_tokens, prefix_reuse=self.reuse
        )
        total = self.system_tokens + self.user_tokens
        self.shared = shared_prefix_tokens(self.system_tokens, self.user_tokens, self.reuse)
        self._shared_ids = self.maker.token_ids(total, f"shared-{self.seed}")

    def next_request(self, index: int, conversation: Conversation) -> LLMRequest:
        total = self.system_tokens + self.user_tokens
        unique = self.maker.token_ids(total, f"unique-{self.seed}-{index}")
        ids = self._shared_ids[: self.shared] + unique[self.shared :]
        system, user = (
            self.maker.decode(ids[: self.system_tokens]),
            self.maker.decode(ids[self.system_tokens :]),
        )
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return LLMRequest(messages, None, self.max_tokens, total, self.shared)

    def describe(self) -> dict[str, Any]:
        total = self.system_tokens + self.user_tokens
        return {
            "system_tokens": self.system_tokens,
            "user_tokens": self.user_tokens,
            "target_reuse": self.shared / total,
        }


@dataclass
class LongDocQA:
    """A few long documents, many questions about each (the document is the reusable prefix)."""

    maker: TextMaker
    num_docs: int
    doc_tokens: int
    question_tokens: int
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = 0
    name: str = "long_doc_qa"

    def __post_init__(self) -> None:
        _check(
            self.name,
            num_docs=self.num_docs,
            doc_tokens=self.doc_tokens,
            question_tokens=self.question_tokens,
        )
        self._docs = [self.maker.text(self.doc_tokens, f"doc-{self.seed}-{i}") for i in range(self.num_docs)]

    def next_request(self, index: int, conversation: Conversation) -> LLMRequest:
        doc = self._docs[index % self.num_docs]
        question = self.maker.text(self.question_tokens, f"question-{self.seed}-{index}")
        messages = [
            {"role": "system", "content": f"Answer questions about this document.\n\n{doc}"},
            {"role": "user", "content": f"Question: {question}?"},
        ]
        return LLMRequest(
            messages, None, self.max_tokens, self.doc_tokens + self.question_tokens, self.doc_tokens
        )

    def describe(self) -> dict[str, Any]:
        return {
            "num_docs": self.num_docs,
            "doc_tokens": self.doc_tokens,
            "question_tokens": self.question_tokens,
            "target_reuse": self.doc_tokens / (self.doc_tokens + self.question_tokens),
        }


@dataclass
class MultiTurn:
    """Conversations that grow turn by turn; each turn resends the whole history (the reusable prefix)."""

    maker: TextMaker
    turns: int
    turn_tokens: int
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = 0
    name: str = "multi_turn"
    _conversations: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        _check(self.name, turns=self.turns, turn_tokens=self.turn_tokens)

    def next_request(self, index: int, conversation: Conversation) -> LLMRequest:
        if conversation.turn >= self.turns:
            conversation.messages.clear()
            conversation.tokens = conversation.turn = 0
        if not conversation.messages:
            conversation.messages.append(
                {"role": "system", "content": f"Conversation {next(self._conversations)}."}
            )
        message = self.maker.text(self.turn_tokens, f"turn-{self.seed}-{index}")
        history = conversation.tokens
        conversation.messages.append({"role": "user", "content": message})
        conversation.turn += 1
        return LLMRequest(
            list(conversation.messages), None, self.max_tokens, history + self.turn_tokens, history
        )

    def record_answer(self, conversation: Conversation, answer: str, answer_tokens: int) -> None:
        conversation.messages.append({"role": "assistant", "content": answer})
        conversation.tokens += self.turn_tokens + answer_tokens

    def describe(self) -> dict[str, Any]:
        # Turn k resends (k-1) earlier turns: over a conversation, the reusable share is the history's.
        history = sum(range(self.turns)) * self.turn_tokens
        return {
            "turns": self.turns,
            "turn_tokens": self.turn_tokens,
            "target_reuse": history / (history + self.turns * self.turn_tokens),
        }


# One request a line: a prompt of 4 MiB is about a million tokens, past any model's context.
MAX_REPLAY_LINE_BYTES = 4 * 1024 * 1024


@dataclass
class Replay:
    """A user's own prompts: JSONL lines of {"messages": [...]} or {"prompt": "..."}, optional max_tokens."""

    path: Path
    max_tokens: int = DEFAULT_MAX_TOKENS
    name: str = "replay"
    records: list[LLMRequest] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.records = load_replay(self.path, self.max_tokens)

    def next_request(self, index: int, conversation: Conversation) -> LLMRequest:
        return self.records[index % len(self.records)]

    def describe(self) -> dict[str, Any]:
        return {"path": str(self.path), "requests": len(self.records), "target_reuse": None}


def _replay_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The numbered lines of a replay file: a regular file (a FIFO or a device is refused, never read
    forever), each line at most MAX_REPLAY_LINE_BYTES (one request, not a disk image without newlines)."""
    if not path.exists():
        raise WorkloadError(
            f"replay file {path} does not exist; pass an existing JSONL file with --replay-file"
        )
    try:
        with open_regular(path, "a JSONL file of prompts") as file:
            for number, raw in enumerate(iter(lambda: file.readline(MAX_REPLAY_LINE_BYTES + 1), b""), 1):
                if len(raw) > MAX_REPLAY_LINE_BYTES:
                    raise WorkloadError(
                        f"{path}:{number}: longer than {MAX_REPLAY_LINE_BYTES // 2**20} MiB; each line must "
                        "be one JSON request"
                    )
                yield number, raw.decode("utf-8")
    except ConfigError as exc:
        raise WorkloadError(f"replay file {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise WorkloadError(
            f"replay file {path} cannot be read ({why}); pass a JSONL file of prompts"
        ) from None


def load_replay(path: Path, default_max_tokens: int) -> list[LLMRequest]:
    """Parse a replay file, naming the line and the fix for anything wrong."""
    records = []
    for number, line in _replay_lines(path):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise WorkloadError(
                f"{path}:{number}: not valid JSON ({exc.msg}); each line must be one JSON object"
            ) from None
        records.append(replay_record(item, f"{path}:{number}", default_max_tokens))
    if not records:
        raise WorkloadError(
            f"replay file {path} has no requests; add JSONL lines with 'messages' or 'prompt'"
        )
    return records


def replay_record(item: Any, where: str, default_max_tokens: int) -> LLMRequest:
    """One replay line ({"messages": [...]} or {"prompt": "..."}, optional max_tokens) as a request;
    WorkloadError naming WHERE (file:line) for anything else."""
    if not isinstance(item, dict) or ("messages" in item) == ("prompt" in item):
        raise WorkloadError(f"{where}: expected an object with exactly one of 'messages' or 'prompt'")
    max_tokens = item.get("max_tokens", default_max_tokens)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise WorkloadError(f"{where}: 'max_tokens' must be a positive integer")
    if "prompt" in item:
        if not isinstance(item["prompt"], str):
            raise WorkloadError(f"{where}: 'prompt' must be a string")
        return LLMRequest(None, item["prompt"], max_tokens)
    messages = item["messages"]
    valid = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not valid:
        raise WorkloadError(
            f"{where}: 'messages' must be a non-empty list of {{'role': ..., 'content': ...}}"
        )
    return LLMRequest([{"role": m["role"], "content": m["content"]} for m in messages], None, max_tokens)
