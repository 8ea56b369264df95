"""The checks a request passes before any engine sees it, and the OpenAI-style errors the router answers.

A missing or wrong API key, a body larger than any prompt the engines take, a body that is not a JSON
object, an unknown model and a prompt longer than the engines' context are refused here, each with the
reason the refusals metric counts it under.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from kvtune.router.prompt_tokens import PromptTooLong, TokenizeLanes
from kvtune.router.proxy_settings import ProxySettings, Tokenize
from kvtune.router.request_limits import BodyTooLarge, read_body


def openai_error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": code or kind}}, status_code=status
    )


class Refused(Exception):
    """A request the router answers itself, with an OpenAI-style error; REASON labels the metric."""

    def __init__(
        self,
        reason: str,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.response = openai_error(status, message, kind, code)


@dataclass(frozen=True)
class Admitted:
    """A request that passed every check: the client's own bytes, their JSON, and the prompt's tokens."""

    raw: bytes
    body: dict[str, Any]
    tokens: list[int]
    session: str | None


@dataclass(frozen=True)
class Admission:
    settings: ProxySettings
    tokenize: Tokenize
    max_body_bytes: int
    # Where prompts are tokenised, off the event loop (prompt_tokens.TokenizeLanes); None: on it.
    lanes: TokenizeLanes | None = None

    def check_key(self, request: Request) -> None:
        api_key = self.settings.api_key
        if api_key is None:
            return
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise Refused(
                "api_key", 401, "Invalid or missing API key", "authentication_error", "invalid_api_key"
            )

    async def admit(self, request: Request, endpoint: str) -> Admitted:
        """The request, checked in the order above; Refused at the first check it fails."""
        self.check_key(request)
        raw = await self._read(request)
        body = self._json_object(raw)
        self._check_model(body)
        tokens = await self._prompt_tokens(body, endpoint, len(raw))
        return Admitted(raw, body, tokens, self._session(request, body))

    async def _read(self, request: Request) -> bytes:
        try:
            return await read_body(request, self.max_body_bytes)
        except BodyTooLarge as exc:
            raise Refused("too_large", 413, str(exc), code="request_too_large") from None

    @staticmethod
    def _json_object(raw: bytes) -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise Refused("not_json", 400, f"the request body is not JSON: {exc}") from None
        except RecursionError:
            raise Refused("not_json", 400, "the request body is JSON nested too deep to read") from None
        if not isinstance(body, dict):
            raise Refused("not_json", 400, "the request body must be a JSON object")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model, served = body.get("model"), self.settings.served_model_name
        if model != served:
            message = f"The model `{model}` does not exist; this router serves `{served}`"
            raise Refused("unknown_model", 404, message, "NotFoundError", "model_not_found")

    async def _prompt_tokens(self, body: dict[str, Any], endpoint: str, size: int) -> list[int]:
        try:
            if self.lanes is None:
                tokens = self.tokenize(body, endpoint)
            else:
                tokens = await self.lanes.tokenize(self.tokenize, body, endpoint, size)
        except PromptTooLong as exc:
            raise Refused("too_long", 400, str(exc), code="context_length_exceeded") from None
        except (ValueError, TypeError, KeyError, RecursionError) as exc:
            raise Refused("bad_prompt", 400, f"the prompt cannot be read: {exc}") from None
        limit = self.settings.max_model_len
        if limit is not None and len(tokens) >= limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(tokens)} tokens."
            )
            raise Refused("too_long", 400, message, code="context_length_exceeded")
        return tokens

    def _session(self, request: Request, body: dict[str, Any]) -> str | None:
        value = request.headers.get(self.settings.session_header) or body.get("user")
        return str(value) if value else None
