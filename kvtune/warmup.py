"""Cache warm-up: send a profile's shared prefixes to a ready engine, so first users hit a warm cache."""

from __future__ import annotations

import logging
import time

import httpx

from kvtune import openai_client
from kvtune.profile import EngineProfile

log = logging.getLogger(__name__)

# The user turn that follows a warmed system prompt. The system part of the chat template is identical
# for every user, so it is what the prefix cache keeps; one generated token is enough to fill it.
_WARMUP_USER_TURN = "Hello."


def warm_up(profile: EngineProfile, client: httpx.Client | None = None) -> float:
    """Send every warm-up prefix of `profile` to its engine; returns the seconds it took."""
    if client is None:
        with openai_client.client_for(profile.api_key()) as own:
            return warm_up(profile, own)
    start = time.monotonic()
    for index, prefix in enumerate(profile.warmup):
        text = prefix.content()
        if prefix.role == "system":
            messages = [{"role": "system", "content": text}, {"role": "user", "content": _WARMUP_USER_TURN}]
            openai_client.chat(client, profile.url, profile.api_model_name, messages, max_tokens=1)
        else:
            openai_client.complete(client, profile.url, profile.api_model_name, text, max_tokens=1)
        log.info("engine %s: warmed prefix %d (%d chars)", profile.name, index, len(text))
    return time.monotonic() - start
