"""The base URL of a server a user names for kvtune to read (a vLLM engine, a Prometheus server), checked
once for the commands that take one: http or https, a host, a port in range, and nothing after the path.

Anything else fails later with less to say (`javascript:...` and `file:///` are no server; a `?query` or
`#fragment` would be pasted into the middle of every call's URL). A refused URL is shown without its password,
and without its query, which may hold one.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtune.http_client import shown_url


class ServerUrlError(ValueError):
    """A URL that is no server's base URL; str() says why and never shows a password."""


def server_url(url: str, example: str, *, userinfo: bool = True) -> str:
    """URL without surrounding blanks or a trailing slash; ServerUrlError when it is not an http(s) URL with
    a host (and a port in range) and no query or fragment, or (USERINFO False: the URL is stored or shown
    elsewhere, e.g. in a Grafana data source) when it carries a user or password."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        usable = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError:  # "http://[::1", "http://host:99999"
        usable = False
    if not usable:
        shown = shown_url(text.split("?", 1)[0].split("#", 1)[0])[:200]
        raise ServerUrlError(
            f"{shown!r}: expected a base URL such as {example} (http:// or https://, a host)"
        )
    base = f"{parts.scheme}://{'...@' if '@' in parts.netloc else ''}{parts.netloc.rsplit('@', 1)[-1]}"
    if parts.query or parts.fragment or text.endswith(("?", "#")):
        raise ServerUrlError(
            f"{base}{parts.path}...: a base URL ends at its path; drop the ?query or #fragment (not shown: "
            f"it may hold a credential), such as {example}"
        )
    if not userinfo and "@" in parts.netloc:
        host = parts.netloc.rsplit("@", 1)[1]  # a user alone may be a token (https://TOKEN@host): not shown
        raise ServerUrlError(
            f"'{parts.scheme}://...@{host}{parts.path}': carries a user or password, which would be stored "
            "with it as written; give the URL without them"
        )
    return text.rstrip("/")
