"""How large a request body the router reads, and reading one no larger.

The limit is sized so no request the engines would take is refused: a prompt of max_model_len tokens,
each standing for at most L bytes of text (token_bytes.py; 256 when the tokenizer gives no bound), each
byte written by the client's JSON in at most 6 bytes (`\\u00XX`, or `\\uXXXX` escapes of non-ASCII
characters), plus room for everything else a request carries (sampling parameters, stop strings, a
logit_bias over the vocabulary, tool schemas, each chat message's own keys). SmolLM2 (8,192 tokens,
L = 81) gets about 8 MB: a body larger is refused before it is read in full, let alone forwarded.
"""

from __future__ import annotations

from starlette.requests import Request

JSON_ESCAPE_BYTES = 6
ASSUMED_TOKEN_BYTES = 256
OTHER_FIELDS_BYTES = 4 << 20
# When the context length is unknown nothing sizes the limit: a bound far above any real prompt.
UNKNOWN_CONTEXT_BODY_BYTES = 64 << 20
# What `kvtune up --router-max-body-mib` may set, MiB. Below ~1 KiB not even a short chat request with its
# sampling parameters fits (a limit of a few bytes refuses everything); above 4 GiB, past the default of a
# million-token context at the assumed 256 bytes a token (about 1.4 GiB), a body read whole is a typo.
SMALLEST_MAX_BODY_MIB = 0.001
LARGEST_MAX_BODY_MIB = 4096.0


def default_max_body_bytes(max_model_len: int | None, token_bytes: int | None) -> int:
    if max_model_len is None:
        return UNKNOWN_CONTEXT_BODY_BYTES
    per_token = JSON_ESCAPE_BYTES * (token_bytes or ASSUMED_TOKEN_BYTES)
    return max_model_len * per_token + OTHER_FIELDS_BYTES


class BodyTooLarge(Exception):
    def __init__(self, limit_bytes: int) -> None:
        super().__init__(
            f"the request body is larger than {limit_bytes:,} bytes, the most this router reads (a prompt "
            "of the model's whole context fits in it)"
        )


async def read_body(request: Request, limit_bytes: int) -> bytes:
    """REQUEST's body; BodyTooLarge as soon as its declared length, or the bytes read so far (a chunked
    body declares none), pass LIMIT_BYTES."""
    declared = request.headers.get("content-length", "")
    # The server has already refused a Content-Length that is not a number.
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit_bytes):
        raise BodyTooLarge(limit_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit_bytes:
            raise BodyTooLarge(limit_bytes)
    return bytes(body)
