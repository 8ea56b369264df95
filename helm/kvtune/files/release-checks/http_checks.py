# Generated from kvtune/helm/release_checks/http_checks.py; do not edit.
"""The release's HTTP checks, run by `helm test` in the chart's test pods: the engine answers /health, lists
its served model, completes a prompt, enforces its API key and exports every metric kvtune's dashboards and
alerts query; Locust's web UI answers.

Standard library only: a pod runs this as `python3 -c SCRIPT CHECK [ARGS]` in an image without kvtune. Each
run is one check: one PASS or FAIL line saying what was seen, exit 0 or 1 (2 on a usage error). The API key
comes from the environment (a Secret), goes in a header and is never printed.

Environment: ENGINE_URL, SERVED_MODEL, KVTUNE_API_KEY and API_KEY_SOURCE (the Secret it comes from, for
messages) when the release has a key, LOCUST_URL, REQUEST_TIMEOUT_SECONDS.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

# Far more than vLLM's /metrics page (~100 KiB); a bigger answer is read this far, not whole.
MAX_BODY_BYTES = 16 << 20
COMPLETION_PROMPT = "The capital of France is"
COMPLETION_MAX_TOKENS = 8
DEFAULT_TIMEOUT_S = 120.0
# A sample line of Prometheus' text format starts with the metric's name.
_SAMPLE_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class CheckFailed(Exception):
    """What a check saw instead of what it wanted: the FAIL line's text."""


class Answer(NamedTuple):
    status: int
    body: bytes

    def seen(self) -> str:
        """The status and the start of the body, on one line."""
        start = " ".join(self.body[:200].decode("utf-8", "replace").split())
        return f"HTTP {self.status}: {start}" if start else f"HTTP {self.status}"


class Client:
    """HTTP without proxies (every address is the cluster's own) and with one timeout per request."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def send(self, method: str, url: str, *, key: str = "", payload: Any = None) -> Answer:
        headers = {"Accept": "*/*"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode()
            headers["Content-Type"] = "application/json"
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return Answer(response.status, response.read(MAX_BODY_BYTES))
        except urllib.error.HTTPError as error:
            with error:
                return Answer(error.code, error.read(MAX_BODY_BYTES))
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise CheckFailed(f"{method} {url}: no answer ({reason})") from error


class Release:
    """What the pod's environment says about the release."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.engine_url = environ.get("ENGINE_URL", "").rstrip("/")
        self.served_model = environ.get("SERVED_MODEL", "")
        self.api_key = environ.get("KVTUNE_API_KEY", "")
        self.api_key_source = environ.get("API_KEY_SOURCE", "")
        self.locust_url = environ.get("LOCUST_URL", "").rstrip("/")
        self.client = Client(float(environ.get("REQUEST_TIMEOUT_SECONDS") or DEFAULT_TIMEOUT_S))

    def engine(self, method: str, path: str, *, keyed: bool = True, payload: Any = None) -> Answer:
        if not self.engine_url:
            raise CheckFailed("ENGINE_URL is not set")
        key = self.api_key if keyed else ""
        return self.client.send(method, self.engine_url + path, key=key, payload=payload)


def _json(answer: Answer) -> Any:
    try:
        return json.loads(answer.body)
    except ValueError as error:
        raise CheckFailed(f"not JSON ({error}): {answer.seen()}") from error


def _ok(answer: Answer) -> Answer:
    if answer.status != 200:
        raise CheckFailed(answer.seen())
    return answer


def check_health(release: Release, _args: Sequence[str]) -> str:
    _ok(release.engine("GET", "/health", keyed=False))
    return "HTTP 200"


def check_models(release: Release, _args: Sequence[str]) -> str:
    if not release.served_model:
        raise CheckFailed("SERVED_MODEL is not set")
    listing = _json(_ok(release.engine("GET", "/v1/models")))
    data = listing.get("data") if isinstance(listing, dict) else None
    ids = [str(model.get("id")) for model in data or [] if isinstance(model, dict)]
    if release.served_model not in ids:
        raise CheckFailed(f"{release.served_model} not listed; lists {', '.join(ids) or 'nothing'}")
    return f"lists {', '.join(ids)}"


def check_completion(release: Release, _args: Sequence[str]) -> str:
    if not release.served_model:
        raise CheckFailed("SERVED_MODEL is not set")
    payload = {
        "model": release.served_model,
        "prompt": COMPLETION_PROMPT,
        "max_tokens": COMPLETION_MAX_TOKENS,
    }
    answer = _ok(release.engine("POST", "/v1/completions", payload=payload))
    body = _json(answer)
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices or not isinstance(choices[0], dict):
        raise CheckFailed(f"no choices in the answer: {answer.seen()}")
    return f"max_tokens {COMPLETION_MAX_TOKENS}: {len(choices)} choice(s), text {choices[0].get('text')!r}"


def check_api_key(release: Release, _args: Sequence[str]) -> str:
    source = release.api_key_source or "the API key's Secret"
    if not release.api_key:
        raise CheckFailed(f"KVTUNE_API_KEY is empty: {source} is missing or empty")
    without = release.engine("GET", "/v1/models", keyed=False)
    with_key = release.engine("GET", "/v1/models")
    if without.status != 401 or with_key.status != 200:
        raise CheckFailed(
            f"/v1/models without the key: {without.seen()} (want 401); "
            f"with the key from {source}: {with_key.seen()} (want 200)"
        )
    return f"/v1/models without the key: HTTP 401, with the key from {source}: HTTP 200"


def exported_names(exposition: str) -> set[str]:
    """The metric names that have a sample in a Prometheus text exposition."""
    names = set()
    for line in exposition.splitlines():
        found = _SAMPLE_NAME.match(line)
        if found and line[found.end() : found.end() + 1] in ("{", " "):
            names.add(found.group())
    return names


def check_metrics(release: Release, names: Sequence[str]) -> str:
    if not names:
        raise CheckFailed("no metric names given")
    answer = _ok(release.engine("GET", "/metrics"))
    exported = exported_names(answer.body.decode("utf-8", "replace"))
    missing = [name for name in names if name not in exported]
    if missing:
        raise CheckFailed(
            f"missing {', '.join(missing)} (kvtune's dashboards and alerts query them: their panels show "
            "No data)"
        )
    return f"has all {len(names)} metrics kvtune's dashboards and alerts query"


def check_locust(release: Release, _args: Sequence[str]) -> str:
    if not release.locust_url:
        raise CheckFailed("LOCUST_URL is not set")
    _ok(release.client.send("GET", release.locust_url + "/"))
    stats = _json(_ok(release.client.send("GET", release.locust_url + "/stats/requests")))
    if not isinstance(stats, dict):
        raise CheckFailed(f"GET /stats/requests: not a JSON object: {str(stats)[:200]}")
    state, users, workers = stats.get("state"), stats.get("user_count"), stats.get("worker_count")
    return f"GET / HTTP 200; GET /stats/requests: state {state}, users {users}, workers {workers}"


Check = Callable[[Release, Sequence[str]], str]
# Check name on the command line -> (title on the PASS/FAIL line, check).
CHECKS: dict[str, tuple[str, Check]] = {
    "health": ("GET /health", check_health),
    "models": ("GET /v1/models", check_models),
    "api-key": ("API key", check_api_key),
    "completion": ("POST /v1/completions", check_completion),
    "metrics": ("GET /metrics", check_metrics),
    "locust": ("locust web UI", check_locust),
}


def main(argv: Sequence[str], environ: Mapping[str, str]) -> int:
    if not argv or argv[0] not in CHECKS:
        sys.stderr.write(f"usage: http_checks.py {{{','.join(CHECKS)}}} [ARGS]\n")
        return 2
    title, check = CHECKS[argv[0]]
    try:
        detail = check(Release(environ), argv[1:])
    except CheckFailed as failure:
        sys.stdout.write(f"FAIL  {title}: {failure}\n")
        return 1
    sys.stdout.write(f"PASS  {title}: {detail}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], os.environ))
