# Generated from kvtune/helm/warmup_hook.py; do not edit.
"""Warm a vLLM engine's prefix cache before its pod takes traffic: the chart's postStart hook.

Runs inside vLLM's own container (Python 3.9+, standard library only: the image has neither kvtune nor
httpx) as `python3 /etc/kvtune/warmup/warmup_hook.py /etc/kvtune/warmup/prefixes.json`. Kubernetes keeps a
container out of Running, so out of Ready and the Service, until its postStart hook returns: no user reaches
the pod before its shared prefixes are cached. Each prefix is sent as `kvtune up` sends it (kvtune/warmup.py):
a system prefix as a chat of it and the user turn "Hello.", a raw one as a completion prompt, one token each.

The file: {"model": SERVED_NAME, "readyTimeoutS": N, "prefixes": [{"role": "system"|"raw", "text": "..."}]};
readyTimeoutS bounds the whole run. Environment: KVTUNE_WARMUP_URL (default http://127.0.0.1:8000);
VLLM_API_KEY, the engine's key, sent as a bearer token and never printed; KVTUNE_WARMUP_LOG_COPY, a file
each log line is also written to (default /proc/1/fd/2; empty for none).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
# Kubernetes keeps no output of a postStart hook (a failing one shows only in an event), so each line also
# goes to the stderr of the container's main process (vLLM, PID 1), which is what `kubectl logs` shows.
DEFAULT_LOG_COPY = "/proc/1/fd/2"
USER_TURN = "Hello."  # kvtune.warmup's user turn: the same chat, so the same cached prefix
ROLES = ("system", "raw")
ONE_TOKEN = {"max_tokens": 1, "temperature": 0.0}  # as kvtune.openai_client's chat() and complete() ask
HEALTH_POLL_S = 2.0
HEALTH_TIMEOUT_S = 2.0
PREFIX_TIMEOUT_S = 120.0  # one prefix's prefill; a hung one leaves the rest of readyTimeoutS to the next
EXIT_BAD_FILE = 2


class BadFile(Exception):
    """The prefixes file is not what the chart should have written."""


class DeadlineReached(Exception):
    """readyTimeoutS has passed, wherever the run was (raised by the SIGALRM handler)."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: Any) -> None:  # the key goes to the engine, nowhere else
        return None


def log(message: str) -> None:
    line = f"kvtune warm-up: {message}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    copy = os.environ.get("KVTUNE_WARMUP_LOG_COPY", DEFAULT_LOG_COPY)
    if not copy:
        return
    # Non-blocking: a full or reader-less pipe loses the line rather than hang the hook.
    with contextlib.suppress(OSError):
        fd = os.open(copy, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def read_prefixes(path: str) -> tuple[str, float, list[dict[str, str]]]:
    """The served model name, the deadline in seconds and the prefixes; BadFile naming what is wrong."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise BadFile(f"not readable as JSON ({error})") from error
    if not isinstance(document, dict):
        raise BadFile("not a JSON object")
    unknown = sorted(set(document) - {"model", "readyTimeoutS", "prefixes"})
    if unknown:
        raise BadFile(f"unknown key {unknown[0]!r}; the keys are model, readyTimeoutS, prefixes")
    model, timeout_s, prefixes = (document.get(key) for key in ("model", "readyTimeoutS", "prefixes"))
    if not isinstance(model, str) or not model:
        raise BadFile("model: the served model name must be a non-empty string")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise BadFile(f"readyTimeoutS: {str(timeout_s)[:40]!r} is not a positive number of seconds")
    if not isinstance(prefixes, list):
        raise BadFile("prefixes: must be a list")
    for index, prefix in enumerate(prefixes):
        if not isinstance(prefix, dict) or set(prefix) != {"role", "text"}:
            raise BadFile(f"prefixes[{index}]: must be an object with exactly the keys role and text")
        if prefix["role"] not in ROLES:
            raise BadFile(f"prefixes[{index}].role: {str(prefix['role'])[:40]!r} is not one of system, raw")
        if not isinstance(prefix["text"], str) or not prefix["text"]:
            raise BadFile(f"prefixes[{index}].text: must be a non-empty string")
    return model, float(timeout_s), prefixes


def request_for(model: str, prefix: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The path and body kvtune.warmup (through kvtune.openai_client) sends for `prefix`."""
    text = prefix["text"]
    if prefix["role"] == "system":
        messages = [{"role": "system", "content": text}, {"role": "user", "content": USER_TURN}]
        return "/v1/chat/completions", {"model": model, "messages": messages, **ONE_TOKEN}
    return "/v1/completions", {"model": model, "prompt": text, **ONE_TOKEN}


def send(url: str, timeout_s: float, body: dict[str, Any] | None = None, key: str = "") -> str:
    """Empty when answered 200, else what happened (never the answer's body: it may quote the prompt)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)  # noqa: S310 (http(s) checked)
    # No proxies (a proxy variable meant for model downloads must not carry the key) and no redirects.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())
    try:
        with opener.open(request, timeout=timeout_s) as response:
            response.read()
            return ""
    except urllib.error.HTTPError as error:
        error.close()
        return f"HTTP {error.code}"
    except (OSError, http.client.HTTPException) as error:
        return f"no answer ({getattr(error, 'reason', error)})"


def wait_healthy(base: str) -> None:
    """Return once GET /health answers 200 (the deadline's alarm ends the wait otherwise)."""
    last = ""
    while True:
        problem = send(f"{base}/health", HEALTH_TIMEOUT_S)
        if not problem:
            return
        if problem != last:
            log(f"waiting for the engine: /health {problem}")
            last = problem
        time.sleep(HEALTH_POLL_S)


def _deadline(_signum: int, _frame: Any) -> None:
    raise DeadlineReached


def refuse(problem: str) -> int:
    """A malformed file is a chart bug, not a slow engine: exit non-zero so Kubernetes fails the hook and
    restarts the container, loud in events and logs, rather than run an engine that silently never warms."""
    log(f"{problem} (a chart bug: the hook fails)")
    return EXIT_BAD_FILE


def main(argv: list[str]) -> int:
    started = time.monotonic()
    if len(argv) != 2:
        log(f"usage: {argv[0]} PREFIXES_JSON")
        return EXIT_BAD_FILE
    try:
        model, timeout_s, prefixes = read_prefixes(argv[1])
    except BadFile as error:
        return refuse(f"prefixes file {argv[1]}: {error}")
    base = (os.environ.get("KVTUNE_WARMUP_URL") or DEFAULT_URL).rstrip("/")
    if not base.startswith(("http://", "https://")):
        return refuse(f"KVTUNE_WARMUP_URL {base[:80]!r} is not an http(s) URL")
    # Every other outcome exits 0: a failing postStart hook gets the container killed, and a missed warm-up
    # must not take a healthy engine down (the startup probe decides readiness).
    key = os.environ.get("VLLM_API_KEY", "")
    warmed = 0
    signal.signal(signal.SIGALRM, _deadline)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        log(f"waiting for {base}/health, at most {timeout_s:g} s in all")
        wait_healthy(base)
        log(f"engine healthy after {time.monotonic() - started:.1f} s; sending {len(prefixes)} prefix(es)")
        for index, prefix in enumerate(prefixes):
            path, body = request_for(model, prefix)
            problem = send(base + path, PREFIX_TIMEOUT_S, body, key)
            warmed += not problem
            what = f"prefix {index} ({prefix['role']}, {len(prefix['text'])} chars)"
            log(f"{what}: {problem}, skipped" if problem else f"{what}: warmed")
    except DeadlineReached:
        log(f"readyTimeoutS ({timeout_s:g} s) reached; the engine starts without the rest of its warm-up")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    log(f"warmed {warmed} of {len(prefixes)} prefix(es) in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
