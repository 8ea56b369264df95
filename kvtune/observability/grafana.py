"""Grafana over its HTTP API (grafana_client): kvtune's folder, dashboards, Prometheus data source, and
annotations (kvtune.sweep.grafana_annotations posts one per sweep trial).

Every failure becomes one GrafanaError that names the Grafana URL and the fix; its `kind` tells a caller
whether the address or the credential was wrong (nothing could be done) or a request was refused later.

grafana_client reads each answer whole through a requests Session, whose timeout bounds one socket read
only: a Grafana (or anything at its URL) that sends a byte a second, or an endless body, would hold the
push for ever and fill memory. Rather than give up the client, kvtune mounts its own transport adapter on
that session (the hook requests offers for this): every answer is read through `kvtune.http_client`'s
`read_body`, with the same total deadline and size cap as kvtune's other calls, and redirects are not
followed. Each answer is then checked for the shape kvtune reads before a field is taken from it.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote, urljoin

import httpx
import requests.adapters
import requests.exceptions
import urllib3.exceptions
from grafana_client.api import GrafanaApi
from grafana_client.client import GrafanaException, GrafanaUnauthorizedError

from kvtune import http_client
from kvtune.credentials import name_may_be_shown, not_a_variable_name
from kvtune.http_client import json_kind, shown_url
from kvtune.server_url import ServerUrlError, server_url

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
MAX_TIMEOUT_S = 600.0
_READ_STEP = 64 * 1024
# Grafana's limit on folder and dashboard uids.
_MAX_UID = 40
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")]+)")

ErrorKind = Literal["invalid", "unreachable", "rejected", "failed"]


class GrafanaError(Exception):
    """What went wrong with Grafana, with the URL and the fix; str() is the user-facing message.

    kind: "invalid" (a bad URL or credential variable), "unreachable" (nothing at the URL answers as
    Grafana), "rejected" (401/403: the credential is wrong or lacks the role), "failed" (another refusal).
    """

    def __init__(self, message: str, kind: ErrorKind) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Credential:
    """A token or a (user, password) pair, with how to name it in messages (never its value)."""

    secret: str | tuple[str, str]
    label: str  # e.g. "the token in $GRAFANA_TOKEN"
    fix: str  # what to do when Grafana rejects it


@dataclass(frozen=True)
class PushedDashboard:
    uid: str
    title: str
    url: str
    version: int | None


DatasourceChange = Literal["created", "updated", "unchanged"]


def folder_uid(title: str) -> str:
    """A stable folder uid from its title ("kvtune" -> "kvtune"), within Grafana's uid rules."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", title.lower()).strip("-")[:_MAX_UID]
    return slug or "kvtune"


def credential_from_env(
    *, token_env: str | None = None, user: str | None = None, password_env: str | None = None
) -> Credential:
    """The token (or the user's password) read from the environment variable named; values never come
    from a command line, where `ps` and shell history would show them."""
    if token_env is not None:
        token = _read_env(token_env, "token")
        return Credential(
            token,
            f"the token in ${token_env}",
            f"set {token_env} to a valid Grafana service account token (Administration > Service accounts)",
        )
    if user is None or password_env is None:
        raise GrafanaError(
            "no Grafana credential: name the variable holding a service account token, or a user and the "
            "variable holding its password",
            "invalid",
        )
    password = _read_env(password_env, "password")
    return Credential(
        (user, password),
        f"user {user!r} with the password in ${password_env}",
        f"check the user name and set {password_env} to its password",
    )


def _read_env(name: str, what: str) -> str:
    if not_a_variable_name(name):
        # Not echoed: a value given where a name belongs may be the secret itself.
        raise GrafanaError(
            f"the Grafana {what} is read from an environment variable: give the variable's name "
            f"(letters, digits and '_', e.g. GRAFANA_TOKEN), never the {what} itself",
            "invalid",
        )
    value = os.environ.get(name, "")
    if not value and not name_may_be_shown(name):
        # Variables are named in capitals; a lower-case "name" that is not set may be a secret mistyped.
        raise GrafanaError(
            f"the environment variable named for the Grafana {what} is not set (its name is not shown: it "
            f"may be the {what} itself); give the name of a variable that holds it, e.g. GRAFANA_TOKEN",
            "invalid",
        )
    if not value:
        raise GrafanaError(
            f"{name} is not set: export {name}=<the Grafana {what}>, or name the variable that holds it",
            "invalid",
        )
    return value


class BoundExceeded(requests.exceptions.RequestException):
    """An answer that broke kvtune's HTTP policy (too slow, too big, an encoding not asked for)."""


class _BoundedAdapter(requests.adapters.HTTPAdapter):
    """requests' transport, reading each answer whole through kvtune's HTTP policy before requests (and
    grafana_client above it) sees it: a total deadline, a size cap, gzip and deflate only."""

    def __init__(self, deadline_s: float) -> None:
        super().__init__(max_retries=0)
        self.deadline_s = deadline_s

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: float | tuple[float | None, float | None] | None = None,
        verify: bool | str = True,
        cert: Any = None,
        proxies: Any = None,
    ) -> requests.Response:
        started = time.monotonic()
        request.headers["Accept-Encoding"] = http_client.ACCEPT_ENCODING
        connect, read = timeout if isinstance(timeout, tuple) else (timeout, timeout)
        bounded = (http_client.capped(connect, self.deadline_s), http_client.capped(read, self.deadline_s))
        response = super().send(
            request, stream=True, timeout=bounded, verify=verify, cert=cert, proxies=proxies
        )
        try:
            body = http_client.read_body(
                _raw_chunks(response),
                response.headers.get("Content-Encoding", ""),
                request.url or "",
                started=started,
                deadline_s=self.deadline_s,
            )
        except httpx.HTTPError as exc:  # LimitExceeded, UnexpectedEncoding: said in requests' terms
            raise BoundExceeded(str(exc), request=request) from None
        finally:
            response.close()
        # requests has no public way to hand a response its body; `_content` is where it keeps it once read.
        response._content = body
        response.headers.pop("Content-Encoding", None)
        return response


def _raw_chunks(response: requests.Response) -> Iterator[bytes]:
    """The body as it comes off the socket: read1 returns what one read gives (read() would wait for a
    whole buffer, and a byte-a-second server would never let the deadline be checked)."""
    try:
        while chunk := response.raw.read1(_READ_STEP, decode_content=False):
            yield chunk
    except urllib3.exceptions.ReadTimeoutError as exc:
        raise requests.exceptions.ReadTimeout(exc, request=response.request) from None
    except (urllib3.exceptions.HTTPError, OSError) as exc:
        raise requests.exceptions.ConnectionError(exc, request=response.request) from None


def _session_bounded(api: GrafanaApi, deadline_s: float) -> None:
    session: requests.Session = api.client.s
    adapter = _BoundedAdapter(deadline_s)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    session.max_redirects = 0  # a redirect raises TooManyRedirects: told as such, never followed


def connect(url: str, credential: Credential, *, timeout: float = DEFAULT_TIMEOUT_S) -> Grafana:
    """A client for the Grafana at `url`, checked: it answers as Grafana and accepts the credential.

    `timeout` bounds each call whole (connecting, waiting, reading the answer)."""
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
        raise GrafanaError(
            f"--timeout {timeout:g}: give the seconds each Grafana answer may take, above 0 and at most "
            f"{MAX_TIMEOUT_S:g} (e.g. {DEFAULT_TIMEOUT_S:g})",
            "invalid",
        )
    try:
        # Grafana's address is shown and logged: no user or password in it (the credential is named apart).
        server_url(url, "http://127.0.0.1:3000", userinfo=False)
    except ServerUrlError as exc:
        raise GrafanaError(f"the Grafana URL {exc}", "invalid") from None
    api = GrafanaApi.from_url(url, credential.secret, timeout=timeout)
    _session_bounded(api, timeout)
    grafana = Grafana(api, url, credential, timeout)
    try:
        grafana.check()
    except BaseException:
        grafana.close()
        raise
    return grafana


def connect_with_env(
    url: str,
    *,
    token_env: str | None = None,
    user: str | None = None,
    password_env: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Grafana:
    credential = credential_from_env(token_env=token_env, user=user, password_env=password_env)
    return connect(url, credential, timeout=timeout)


class Grafana:
    """One Grafana, one credential: the few calls kvtune makes, each idempotent where it can be."""

    def __init__(self, api: GrafanaApi, url: str, credential: Credential, timeout: float) -> None:
        self.api: Any = api  # grafana_client's methods are unannotated: their answers are JSON anyway
        self.url = url.rstrip("/")
        self.credential = credential
        self.timeout = timeout
        self.version: str | None = None

    def __enter__(self) -> Grafana:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.api.client.s.close()

    def check(self) -> None:
        """Grafana answers at the URL (GET /api/health needs no credential), then accepts the credential."""
        try:
            health = self.api.client.GET("/health")
        except GrafanaException as exc:
            if exc.status_code == 0:
                raise self._unreachable(exc) from exc
            raise self._not_grafana(f"GET /api/health answered {exc.status_code}") from exc
        except requests.exceptions.JSONDecodeError as exc:  # some other web server
            raise self._not_grafana("GET /api/health did not answer JSON") from exc
        except requests.exceptions.RequestException as exc:
            raise self._unreachable(exc) from exc
        if not isinstance(health, dict) or "database" not in health:
            raise self._not_grafana("GET /api/health did not answer Grafana's health document")
        self.version = str(health.get("version") or "") or None
        with self._translated("list dashboards"):
            self.api.search.search_dashboards(limit=1)  # any signed-in identity may; anything else is 401

    def ensure_folder(self, title: str, uid: str) -> str:
        """The uid of the folder `uid`, or of a folder already titled `title`, created when neither exists."""
        doing = f"read folder {uid!r}"
        with self._translated(doing):
            found = self._get_or_none(lambda: self.api.folder.get_folder(uid))
        if found is not None:
            return self._uid(self._object(found, doing), doing)
        with self._translated("list folders"):
            folders = self.api.folder.get_all_folders()
        if not isinstance(folders, list) or not all(isinstance(folder, dict) for folder in folders):
            raise self._misshapen(folders, "list folders", "a list of folders")
        for folder in folders:
            if folder.get("title") == title:  # made by hand, or by another tool: use it, do not duplicate it
                return self._uid(folder, "list folders")
        doing = f"create folder {title!r}"
        with self._translated(doing):
            created = self._object(self.api.folder.create_folder(title, uid=uid), doing)
        made = created.get("uid") if isinstance(created.get("uid"), str) and created.get("uid") else uid
        log.info("created Grafana folder %r (uid %s)", title, made)
        return str(made)

    def push_dashboard(self, model: dict[str, Any], folder_uid: str) -> PushedDashboard:
        """Create or replace the dashboard with the model's uid (overwrite: a second push updates it)."""
        uid, title = model.get("uid"), model.get("title")
        if not isinstance(uid, str) or not uid or not isinstance(title, str) or not title:
            raise ValueError("a dashboard model needs a non-empty 'uid' and 'title'")
        payload = {
            # id None: Grafana finds the dashboard by uid, so an id from another Grafana never collides.
            "dashboard": {**model, "id": None},
            "folderUid": folder_uid,
            "overwrite": True,
            "message": "pushed by kvtune dashboards push",
        }
        doing = f"save dashboard {title!r}"
        with self._translated(doing):
            saved = self._object(self.api.dashboard.update_dashboard(payload), doing)
        path = saved.get("url") if isinstance(saved.get("url"), str) and saved.get("url") else f"/d/{uid}"
        version = saved.get("version")
        version = version if isinstance(version, int) and not isinstance(version, bool) else None
        return PushedDashboard(uid, title, urljoin(self.url + "/", str(path)), version)

    def ensure_prometheus_datasource(self, name: str, url: str) -> tuple[DatasourceChange, str]:
        """A Prometheus data source `name` at `url` (created, its URL updated, or left alone), and its uid."""
        doing = f"read data source {name!r}"
        with self._translated(doing):
            found = self._get_or_none(
                lambda: self.api.datasource.get_datasource_by_name(quote(name, safe=""))
            )
        if found is None:
            body = {"name": name, "type": "prometheus", "url": url, "access": "proxy", "jsonData": {}}
            doing = f"create data source {name!r}"
            with self._translated(doing):
                created = self._object(self.api.datasource.create_datasource(body), doing)
            source = created.get("datasource")
            uid = source.get("uid") if isinstance(source, dict) else None
            return "created", uid if isinstance(uid, str) else ""
        found = self._object(found, doing)
        if found.get("type") != "prometheus":
            raise GrafanaError(
                f"Grafana at {self.url} already has a data source named {name!r} of type "
                f"{str(found.get('type'))[:40]!r}: give the Prometheus one another name",
                "failed",
            )
        uid = self._uid(found, doing)
        if found.get("url") == url:
            return "unchanged", uid
        with self._translated(f"update data source {name!r}"):
            self.api.datasource.update_datasource_by_uid(uid, {**found, "url": url})
        return "updated", uid

    def annotate(
        self,
        text: str,
        tags: list[str],
        time_ms: int,
        time_end_ms: int | None = None,
        dashboard_uid: str | None = None,
    ) -> int | None:
        """Post an annotation (a region when time_end_ms is given); without a dashboard it is the
        organization's, shown by every dashboard whose annotation query matches its tags. Returns its id."""
        with self._translated("add an annotation"):
            added = self.api.annotations.add_annotation(
                dashboard_uid=dashboard_uid, time_from=time_ms, time_to=time_end_ms, tags=tags, text=text
            )
        ident = added.get("id") if isinstance(added, dict) else None
        return int(ident) if ident is not None else None

    # ---- answers and errors --------------------------------------------------------------------------

    def _object(self, answer: Any, doing: str) -> dict[str, Any]:
        """`answer` when it is a JSON object, as every answer kvtune reads fields from must be."""
        if not isinstance(answer, dict):
            raise self._misshapen(answer, doing, "an object")
        return answer

    def _uid(self, thing: dict[str, Any], doing: str) -> str:
        uid = thing.get("uid")
        if not isinstance(uid, str) or not uid:
            raise self._misshapen(thing, doing, "an object with a 'uid'")
        return uid

    def _misshapen(self, answer: Any, doing: str, expected: str) -> GrafanaError:
        return GrafanaError(
            f"Grafana at {self.url} answered {json_kind(answer)} when asked to {doing}, not {expected}: "
            "check that the URL is Grafana's own",
            "failed",
        )

    @staticmethod
    def _get_or_none(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except GrafanaException as exc:
            if exc.status_code == 404:
                return None
            raise

    @contextmanager
    def _translated(self, doing: str) -> Iterator[None]:
        try:
            yield
        except GrafanaUnauthorizedError as exc:
            raise GrafanaError(
                f"Grafana at {self.url} rejected {self.credential.label} (401 Unauthorized): "
                f"{self.credential.fix}",
                "rejected",
            ) from exc
        except GrafanaException as exc:
            if exc.status_code == 0:
                raise self._unreachable(exc) from exc
            if exc.status_code == 403:
                raise GrafanaError(
                    f"Grafana at {self.url} accepted {self.credential.label} but refused to {doing} "
                    "(403 Forbidden): give its service account or user the Editor role "
                    "(Admin for data sources)",
                    "rejected",
                ) from exc
            raise GrafanaError(
                f"Grafana at {self.url} refused to {doing}: {exc.status_code} {_message(exc)}", "failed"
            ) from exc
        except requests.exceptions.JSONDecodeError as exc:  # before RequestException, which it also is
            raise GrafanaError(
                f"Grafana at {self.url} did not answer JSON when asked to {doing}: {exc}", "failed"
            ) from exc
        except requests.exceptions.RequestException as exc:
            raise self._unreachable(exc) from exc

    def _unreachable(self, exc: BaseException) -> GrafanaError:
        if isinstance(exc, requests.exceptions.TooManyRedirects):
            response = exc.response
            location = response.headers.get("Location", "?") if response is not None else "?"
            return GrafanaError(
                f"{self.url} answered with a redirect to {shown_url(location)[:200]!r}, which kvtune does "
                "not follow (the credential would go along): give the URL it points to",
                "unreachable",
            )
        if isinstance(exc, BoundExceeded):
            return GrafanaError(
                f"Grafana at {self.url} did not answer within kvtune's bounds ({exc}): check that the URL is "
                "Grafana's own, or raise --timeout",
                "unreachable",
            )
        if isinstance(exc, requests.exceptions.Timeout):
            reason = f"no answer within {self.timeout:g} s"
        elif isinstance(exc, requests.exceptions.SSLError):
            reason = "its TLS certificate is not trusted; append ?verify=false to the URL to skip the check"
        else:
            text = str(exc)  # urllib3's are long: "HTTPConnectionPool(...): Max retries ... [Errno 111] ..."
            match = _ERRNO.search(text)
            reason = match.group(1).strip() if match else text if 0 < len(text) <= 100 else type(exc).__name__
        return GrafanaError(
            f"cannot reach Grafana at {self.url} ({reason}): check the URL (scheme, host, port) and that "
            "Grafana is running",
            "unreachable",
        )

    def _not_grafana(self, what: str) -> GrafanaError:
        return GrafanaError(
            f"{self.url} does not answer as Grafana ({what}): give the URL of Grafana itself "
            "(e.g. http://127.0.0.1:3000, plus its sub-path if it is served under one)",
            "unreachable",
        )


def _message(exc: GrafanaException) -> str:
    response = exc.response
    if isinstance(response, dict) and "message" in response:
        return str(response["message"])[:200]
    return str(exc.message)[:200]
