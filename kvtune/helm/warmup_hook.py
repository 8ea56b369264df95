"""Warm a vLLM engine's prefix cache before its pod takes traffic: the chart's postStart hook.

Runs inside vLLM's own container (Python 3.9+, standard library only: the image has neither kvtune nor
httpx) as `python3 /etc/kvtune/warmup/warmup_hook.py /etc/kvtune/warmup/prefixes.json`. Kubernetes keeps a
container out of Running, so out of Ready and the Service, until its postStart hook returns: no user reaches
the pod before its shared prefixes are cached. Each prefix is sent as `kvtune up` sends it (kvtune/warmup.py):
a system prefix as a chat of it and the user turn "Hello.", a raw one as a completion prompt, one token each.

The file: {"model": SERVED_NAME, "readyTimeoutS": N, "prefixes": [{"role": "system"|"raw", "text": "..."}]};
readyTimeoutS (1 s to a day) bounds the whole run. Environment: KVTUNE_WARMUP_URL, the engine's base URL
(default http://127.0.0.1:8000; no user, password or query); VLLM_API_KEY, the engine's key, sent as a
bearer token (whitespace around it, as `kubectl create secret --from-file` leaves, is stripped);
KVTUNE_WARMUP_LOG_COPY, a file each log line is also written to (default /proc/1/fd/2; empty for none).

Without kvtune, the hook keeps bounds like kvtune's own (kvtune.documents, kvtune.http_client; a test checks
the shared ones agree): the file is a regular file of at most 1 MiB nested at most 50 deep, each answer is
read in chunks, up to 1 MiB and a deadline, and an alarm bounds everything from the first line on. Nothing
it prints holds the key, a URL's user or password, or a prefix's text: Kubernetes shows a failed hook's
output in the pod's events. Exit codes, each with one line on stderr:
  0  ran: every prefix warmed, or some skipped (engine slow or failing, readyTimeoutS reached) - a missed
     warm-up never takes a healthy engine down, the startup probe decides readiness;
  1  the hook itself failed (a bug): the line names the error's type only;
  2  refused before sending anything: the file, KVTUNE_WARMUP_URL or VLLM_API_KEY is not what the chart
     writes; the line names which and the fix. Kubernetes restarts the container, loud in its events.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import stat
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

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

# readyTimeoutS: below a second no engine answers (and a probe period is whole seconds); kvtune's longest
# wait (kvtune.profile.LONGEST_WAIT_S) is a day. The chart's schema refuses the same range.
MIN_READY_TIMEOUT_S = 1.0
MAX_READY_TIMEOUT_S = 86400.0
# The file comes from a ConfigMap, which Kubernetes caps at 1 MiB; it nests three levels (kvtune's own
# documents stop at 50, well below Python's recursion limit).
MAX_FILE_BYTES = 2**20
MAX_DEPTH = 50
# Reading the file, before its readyTimeoutS is known, is bounded too (a stuck volume).
READ_FILE_S = 30.0
# A one-token answer is under 1 KB and /health is empty: a larger body is not an engine's.
MAX_ANSWER_BYTES = 2**20
CHUNK_BYTES = 64 * 1024
MAX_URL_CHARS = 2048
MAX_KEY_CHARS = 4096  # HTTP servers refuse header lines much past this (h11: 16 KiB for all headers)

EXIT_OK = 0
EXIT_HOOK_FAILED = 1
EXIT_REFUSED = 2


class Refused(Exception):
    """An input the chart should not have given; str() names it and the fix, and never holds a credential."""


class DeadlineReached(Exception):
    """The alarm went off (raised by the SIGALRM handler), wherever the run was."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_args: Any) -> None:  # the key goes to the engine, nowhere else
        return None


def log(message: str, environ: Mapping[str, str] | None = None) -> None:
    # One line, whatever a message quotes (repr() already escapes what it shows).
    line = "kvtune warm-up: " + message.replace("\r", "\\r").replace("\n", "\\n") + "\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    copy = (os.environ if environ is None else environ).get("KVTUNE_WARMUP_LOG_COPY", DEFAULT_LOG_COPY)
    if not copy:
        return
    # Non-blocking: a full or reader-less pipe loses the line rather than hang the hook.
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(copy, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            os.write(fd, line.encode("utf-8", "backslashreplace"))
        finally:
            os.close(fd)


def quoted(value: object, limit: int = 40) -> str:
    """`value` as a message may quote it: repr(), cut to `limit` characters."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python converts
        return "a number too long to show"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- the prefixes file -------------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a pipe"  # read once, and blocks without a writer
    return "a device or socket"  # /dev/zero never ends


def read_regular(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; Refused naming what it is otherwise.

    O_NONBLOCK: opening a FIFO nobody writes to returns at once rather than wait for a writer; the kind is
    read from the descriptor, so what is checked is what is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        raise Refused(f"cannot be opened ({error.strerror or type(error).__name__})") from None
    except ValueError:  # a NUL byte in the path
        raise Refused("is not a usable path") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise Refused(f"is {_kind(mode)}, not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, min(CHUNK_BYTES, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as error:
        raise Refused(f"cannot be read ({error.strerror or type(error).__name__})") from None
    finally:
        os.close(fd)
    if size > limit:
        raise Refused(f"is larger than {limit // 1024} KiB, more than a ConfigMap holds")
    return b"".join(chunks)


# A JSON string (skipped whole: brackets in it do not nest) or a bracket.
_JSON_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


def nesting_depth(text: str, stop_after: int = MAX_DEPTH) -> int:
    """How deeply the arrays and objects of a JSON text nest, counted up to `stop_after` + 1; checked
    before parsing, since Python's parser recurses once per level and fails with RecursionError."""
    depth = deepest = 0
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > stop_after:
                break
        elif token in ("]", "}"):
            depth -= 1
    return deepest


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise Refused(f"key {quoted(key)} is written twice in one object")
        document[key] = value
    return document


def _not_json(constant: str) -> NoReturn:
    raise Refused(f"{constant} is not standard JSON")


def parse(raw: bytes) -> Any:
    """The JSON value of `raw`: UTF-8, nested at most MAX_DEPTH deep, no key twice, no NaN or Infinity."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise Refused(f"is not UTF-8 text (at byte {error.start})") from None
    if nesting_depth(text) > MAX_DEPTH:
        raise Refused(f"nests more than {MAX_DEPTH} levels deep (the chart writes three)")
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_not_json)
    except (ValueError, RecursionError) as error:
        # JSONDecodeError says where, never what (a prefix's text may be private).
        where = (
            f" at line {error.lineno} column {error.colno}" if isinstance(error, json.JSONDecodeError) else ""
        )
        raise Refused(f"is not JSON{where}") from None


def ready_timeout_problem(value: object) -> str | None:
    """Why readyTimeoutS `value` is refused, or None: seconds from MIN_ to MAX_READY_TIMEOUT_S."""
    fix = f"give seconds from {MIN_READY_TIMEOUT_S:g} to {MAX_READY_TIMEOUT_S:g} (engine.readyTimeoutS)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"readyTimeoutS: {quoted(value)} is not a number; {fix}"
    if not MIN_READY_TIMEOUT_S <= value <= MAX_READY_TIMEOUT_S:  # NaN compares false, so is refused too
        return f"readyTimeoutS: {quoted(value)} is out of range; {fix}"
    return None


def read_prefixes(path: str) -> tuple[str, float, list[dict[str, str]]]:
    """The served model name, the deadline in seconds and the prefixes; Refused naming what is wrong."""
    document = parse(read_regular(path))
    if not isinstance(document, dict):
        raise Refused("is not a JSON object")
    unknown = sorted(set(document) - {"model", "readyTimeoutS", "prefixes"})
    if unknown:
        raise Refused(f"unknown key {quoted(unknown[0])}; the keys are model, readyTimeoutS, prefixes")
    model: Any = document.get("model")
    timeout_s: Any = document.get("readyTimeoutS")
    prefixes: Any = document.get("prefixes")
    if not isinstance(model, str) or not model:
        raise Refused("model: the served model name must be a non-empty string")
    problem = ready_timeout_problem(timeout_s)
    if problem:
        raise Refused(problem)
    if not isinstance(prefixes, list):
        raise Refused("prefixes: must be a list")
    for index, prefix in enumerate(prefixes):
        if not isinstance(prefix, dict) or set(prefix) != {"role", "text"}:
            raise Refused(f"prefixes[{index}]: must be an object with exactly the keys role and text")
        if prefix["role"] not in ROLES:
            raise Refused(f"prefixes[{index}].role: {quoted(prefix['role'])} is not one of system, raw")
        if not isinstance(prefix["text"], str) or not prefix["text"]:
            raise Refused(f"prefixes[{index}].text: must be a non-empty string")
    return model, float(timeout_s), prefixes


# ---- the environment: the engine's URL and key -------------------------------------------------------------


def shown_url(url: str) -> str:
    """`url` as it may be logged: all after its `scheme://` up to its last @ replaced by ***@ (a user, a
    password, or text that only looks like a host: a malformed URL is hidden rather than parsed), a query or
    fragment by ?***, the whole quoted and cut to 120 characters."""
    query = re.search("[?#]", url)
    head = url[: query.start()] if query else url
    at = head.rfind("@")
    if at >= 0:
        scheme = re.match("[A-Za-z][A-Za-z0-9+.-]*://", head)
        head = (scheme.group() if scheme else "") + "***@" + head[at + 1 :]
    return quoted(head + ("?***" if query else ""), 120)


def _visible_ascii(text: str) -> bool:
    return all("!" <= char <= "~" for char in text)


def engine_url(environ: Mapping[str, str]) -> str:
    """KVTUNE_WARMUP_URL without a trailing slash, checked; Refused showing it with any credential hidden."""
    url = (environ.get("KVTUNE_WARMUP_URL") or DEFAULT_URL).strip()
    at = f"KVTUNE_WARMUP_URL {shown_url(url)}"
    if len(url) > MAX_URL_CHARS:
        raise Refused(
            f"KVTUNE_WARMUP_URL: longer than {MAX_URL_CHARS} characters; give the engine's base URL"
        )
    if not _visible_ascii(url):
        raise Refused(f"{at}: holds a space, control or non-ASCII character; give the engine's base URL")
    scheme, _sep, rest = url.partition("://")
    authority = re.split("[/?#]", rest, maxsplit=1)[0]
    if scheme not in ("http", "https") or not _sep:
        raise Refused(f"{at} is not an http(s) URL; give the engine's base URL, e.g. {DEFAULT_URL}")
    if "@" in url:  # a base URL needs none; anywhere, it may be a credential that urllib would misread
        raise Refused(
            f"{at}: holds a user or password, which the hook never sends (the engine's key goes in "
            "VLLM_API_KEY); remove it from the URL"
        )
    if "?" in url or "#" in url:
        raise Refused(f"{at}: has a query or fragment; give the engine's base URL only")
    host, _colon, port = authority.rpartition(":") if not authority.endswith("]") else (authority, "", "")
    if not authority or (_colon and not (port.isdigit() and 0 < int(port) < 65536 and host)):
        raise Refused(f"{at}: needs a host and, if any, a port from 1 to 65535")
    return url.rstrip("/")


def api_key(environ: Mapping[str, str]) -> tuple[str, bool]:
    """VLLM_API_KEY without whitespace around it, and whether there was some; Refused (never quoting the key)
    when no HTTP client could send it."""
    raw = environ.get("VLLM_API_KEY", "")
    key = raw.strip()
    if len(key) > MAX_KEY_CHARS:
        raise Refused(
            f"VLLM_API_KEY: longer than {MAX_KEY_CHARS} characters; check the Secret holds the key alone"
        )
    bad = next((char for char in key if not "!" <= char <= "~"), None)
    if bad is not None:
        kind = "a space" if bad.isspace() else "a control or non-ASCII character"
        raise Refused(
            f"VLLM_API_KEY: holds {kind} inside the key, which an HTTP header cannot carry (no client could "
            "send it); make the Secret hold the key alone, in visible ASCII"
        )
    return key, key != raw


# ---- the engine --------------------------------------------------------------------------------------------


def _reason(error: BaseException) -> str:
    """What went wrong with a request, from the error's type and the system's wording, never its text (which
    may quote a URL or a header)."""
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, BaseException):
        error = error.reason
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "timed out"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return type(error).__name__


def _drain(response: http.client.HTTPResponse, deadline: float, timeout_s: float) -> str:
    """Read and drop an answer in chunks: empty when it ended within the deadline and MAX_ANSWER_BYTES."""
    size = 0
    while True:
        chunk = response.read1(CHUNK_BYTES)  # what one socket read gives: a slow drip still reaches the clock
        if not chunk:
            return ""
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            return f"answer larger than {MAX_ANSWER_BYTES // 1024} KiB, not read"
        if time.monotonic() > deadline:
            return f"answer not finished within {timeout_s:g} s"


def send(url: str, timeout_s: float, body: dict[str, Any] | None = None, key: str = "") -> str:
    """Empty when answered 2xx, else what happened (never the answer's body: it may quote the prompt).
    Bounded by `timeout_s` in all, plus at most one socket read's `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers=headers)  # noqa: S310 (http(s) checked)
    # No proxies (a proxy variable meant for model downloads must not carry the key) and no redirects.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return _drain(response, deadline, timeout_s)
    except urllib.error.HTTPError as error:
        error.close()
        return f"HTTP {error.code}"
    except (OSError, http.client.HTTPException, ValueError) as error:
        return f"no answer ({_reason(error)})"


def wait_healthy(base: str, environ: Mapping[str, str]) -> None:
    """Return once GET /health answers 2xx (the deadline's alarm ends the wait otherwise)."""
    last = ""
    while True:
        problem = send(f"{base}/health", HEALTH_TIMEOUT_S)
        if not problem:
            return
        if problem != last:
            log(f"waiting for the engine: /health {problem}", environ)
            last = problem
        time.sleep(HEALTH_POLL_S)


# ---- the run -----------------------------------------------------------------------------------------------


def _deadline(_signum: int, _frame: Any) -> None:
    raise DeadlineReached


@contextlib.contextmanager
def alarm() -> Iterator[None]:
    """SIGALRM raises DeadlineReached while inside; the caller's handler and timer come back after (so the
    hook can run in a process that has its own, such as a test runner)."""
    handler = signal.signal(signal.SIGALRM, _deadline) or signal.SIG_DFL  # None: set outside Python
    left, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - started), 0.001), interval)


def refuse(problem: str, environ: Mapping[str, str]) -> int:
    """A malformed input is a chart bug, not a slow engine: exit non-zero so Kubernetes fails the hook and
    restarts the container, loud in events and logs, rather than run an engine that silently never warms."""
    log(f"{problem} (a chart bug: the hook fails)", environ)
    return EXIT_REFUSED


def warm(
    base: str,
    key: str,
    model: str,
    prefixes: list[dict[str, str]],
    timeout_s: float,
    environ: Mapping[str, str],
) -> int:
    """Wait for the engine, then send each prefix: how many were warmed when done or when the alarm cut in."""
    started = time.monotonic()
    warmed = 0
    try:
        log(f"waiting for {shown_url(base + '/health')}, at most {timeout_s:g} s in all", environ)
        wait_healthy(base, environ)
        log(
            f"engine healthy after {time.monotonic() - started:.1f} s; sending {len(prefixes)} prefix(es)",
            environ,
        )
        for index, prefix in enumerate(prefixes):
            path, body = request_for(model, prefix)
            problem = send(base + path, PREFIX_TIMEOUT_S, body, key)
            warmed += not problem
            what = f"prefix {index} ({prefix['role']}, {len(prefix['text'])} chars)"
            log(f"{what}: {problem}, skipped" if problem else f"{what}: warmed", environ)
    except DeadlineReached:
        log(
            f"readyTimeoutS ({timeout_s:g} s) reached; the engine starts without the rest of its warm-up",
            environ,
        )
    return warmed


def request_for(model: str, prefix: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The path and body kvtune.warmup (through kvtune.openai_client) sends for `prefix`."""
    text = prefix["text"]
    if prefix["role"] == "system":
        messages = [{"role": "system", "content": text}, {"role": "user", "content": USER_TURN}]
        return "/v1/chat/completions", {"model": model, "messages": messages, **ONE_TOKEN}
    return "/v1/completions", {"model": model, "prompt": text, **ONE_TOKEN}


def _run(argv: list[str], environ: Mapping[str, str]) -> int:
    started = time.monotonic()
    if len(argv) != 2:
        log(f"usage: {quoted(argv[0] if argv else 'warmup_hook.py', 200)} PREFIXES_JSON", environ)
        return EXIT_REFUSED
    path = argv[1]
    # The alarm (see `alarm`) is set before anything that could block: for the file, then readyTimeoutS.
    signal.setitimer(signal.ITIMER_REAL, READ_FILE_S)
    try:
        model, timeout_s, prefixes = read_prefixes(path)
    except Refused as error:
        return refuse(f"prefixes file {quoted(path, 200)}: {error}", environ)
    except DeadlineReached:
        return refuse(f"prefixes file {quoted(path, 200)}: not read within {READ_FILE_S:g} s", environ)
    try:
        base = engine_url(environ)
        key, stripped = api_key(environ)
    except Refused as error:
        return refuse(str(error), environ)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s - (time.monotonic() - started), 0.001))
    if stripped:
        # vLLM 0.32 compares the key as the Secret holds it: with a newline in it no client can match.
        log(
            "VLLM_API_KEY has whitespace around it (a Secret made with --from-file of a file ending in a "
            "newline?): sent without it, but the engine may refuse every request (HTTP 401); store the key "
            "without the newline",
            environ,
        )
    warmed = warm(base, key, model, prefixes, timeout_s, environ)
    signal.setitimer(signal.ITIMER_REAL, 0)
    log(f"warmed {warmed} of {len(prefixes)} prefix(es) in {time.monotonic() - started:.1f} s", environ)
    return EXIT_OK


def main(argv: list[str], environ: Mapping[str, str] | None = None) -> int:
    """The hook's exit code (see the module docstring); one line on stderr for each outcome, no traceback."""
    environ = os.environ if environ is None else environ
    try:
        with alarm():
            return _run(argv, environ)
    except DeadlineReached:  # between two steps, after `warm` returned
        log("readyTimeoutS reached", environ)
        return EXIT_OK
    except Exception as error:  # noqa: BLE001 - a bug must not print a traceback that may quote a credential
        log(f"the hook failed ({type(error).__name__}): a bug in the hook, please report it", environ)
        return EXIT_HOOK_FAILED


if __name__ == "__main__":
    sys.exit(main(sys.argv))
