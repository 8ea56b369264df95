"""The serving envelope: which requests an engine accepts, and what a sweep may narrow of it.

`max_model_len` is the knob that changes which requests are served: vLLM rejects a request whose prompt
plus output is longer ("maximum context length is N tokens"). A sweep that tries a shorter value than the
base profile's would quietly make its winner refuse traffic the user's engine serves today, so a narrowing
must be acknowledged in the spec, checked against the workload, and stated wherever the winner is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtune import kv_math
from kvtune.loadgen.workload_args import workload_sizes
from kvtune.loadgen.workloads import load_replay
from kvtune.profile import EngineProfile

# Knobs whose value decides which requests an engine accepts (not just how fast it serves them).
ENVELOPE_KNOBS = ("max_model_len",)

# Tokens a chat template adds around the designed prompt (role markers, a default system prompt):
# SmolLM2's adds 14 to a two-message chat; larger templates stay well under this.
CHAT_TEMPLATE_TOKENS = 64
# A replay prompt's tokens, estimated up front without a tokenizer: English text runs at about four
# characters per token; three keeps the estimate on the long side, so a too-long file is caught.
REPLAY_CHARS_PER_TOKEN = 3


def context_tokens(profile: EngineProfile) -> int | None:
    """The longest request (prompt + output) `profile` serves: its max_model_len, else the model's own
    limit when kvtune knows the model; None when neither is known."""
    if profile.max_model_len is not None:
        return profile.max_model_len
    geometry = kv_math.lookup_geometry(profile.model)
    return geometry.max_position_embeddings if geometry else None


@dataclass(frozen=True)
class LongestRequest:
    """The longest request a workload sends, in tokens, and how that figure was made."""

    tokens: int
    how: str


def longest_request(workload: str, args: Mapping[str, str | int | float], max_tokens: int) -> LongestRequest:
    """Prompt plus output of the workload's longest request, with the chat template's margin."""
    margin = CHAT_TEMPLATE_TOKENS
    if workload == "replay":
        records = load_replay(Path(str(args["replay-file"])), max_tokens)
        longest = max(records, key=_replay_chars)
        prompt = -(-_replay_chars(longest) // REPLAY_CHARS_PER_TOKEN)
        return LongestRequest(
            prompt + longest.max_tokens + margin,
            f"~{prompt:,} prompt tokens (the longest replay record, {_replay_chars(longest):,} characters "
            f"at {REPLAY_CHARS_PER_TOKEN} per token) + {longest.max_tokens} output + {margin} for the chat "
            "template",
        )
    sizes = workload_sizes(workload, args)
    if workload == "shared_prefix":
        system, user = sizes.count("system-tokens"), sizes.count("user-tokens")
        parts = f"{system:,} system + {user:,} user"
        prompt = system + user
    elif workload == "long_doc_qa":
        doc, question = sizes.count("doc-tokens"), sizes.count("question-tokens")
        parts = f"one {doc:,}-token document + {question} question"  # a request asks about one document
        prompt = doc + question
    else:  # multi_turn: the last turn carries the whole conversation
        turns, turn = sizes.count("turns"), sizes.count("turn-tokens")
        parts = f"{turns} turns x ({turn:,} user + {max_tokens} answer), less the last answer"
        prompt = turns * (turn + max_tokens) - max_tokens
    return LongestRequest(
        prompt + max_tokens + margin, f"{parts} + {max_tokens} output + {margin} for the chat template"
    )


def _replay_chars(record: object) -> int:
    messages = getattr(record, "messages", None)
    if messages:
        return sum(len(m["content"]) for m in messages)
    return len(getattr(record, "prompt", None) or "")


def narrowing_sentence(deployed: int | None, base: int | None) -> str | None:
    """Plain words for a winner that serves shorter requests than the base profile; None when it does not."""
    if deployed is None or (base is not None and deployed >= base):
        return None
    was = f"the base profile serves up to {base:,}" if base else "the base profile leaves it to the model"
    return (
        f"This config serves requests of at most {deployed:,} tokens (prompt + output); {was}. "
        f"vLLM rejects longer requests ('maximum context length is {deployed} tokens'): the spec's "
        "envelope accepted that."
    )
