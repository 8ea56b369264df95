"""The documentation site as tests meet it: built by mkdocs with --strict, served on 127.0.0.1 by the standard
library, and its built HTML crawled for links that lead nowhere."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from tests.helpers import REPO

# Attributes that point at another file of the site: pages, stylesheets, scripts, images.
LINK_ATTRIBUTES = {("a", "href"), ("link", "href"), ("script", "src"), ("img", "src"), ("source", "src")}


# The lines of mkdocs' log that --strict counts against a build, and its errors.
PROBLEM_LINE = re.compile(r"^(WARNING|ERROR)\b")


def build_problems(built: subprocess.CompletedProcess[str]) -> str | None:
    """What a build's log says went wrong (its warnings and errors, else its last lines), or None when the
    build passed without a warning."""
    lines = (built.stdout + built.stderr).splitlines()
    problems = [line for line in lines if PROBLEM_LINE.match(line)]
    if built.returncode == 0 and not problems:
        return None
    return "\n".join(problems or lines[-20:])


def build_site(site_dir: Path, timeout_s: float = 240.0) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the repository's mkdocs.yml into `site_dir`, as `make docs` runs it.

    The repository is the working directory: the snippets' base paths (docs, .) are relative to it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=REPO,
        # Material's banner about MkDocs 2 is printed on every build: a failure's output shows its cause.
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Requests are not logged: the test's output shows what failed, not every asset fetched."""


@contextmanager
def serving(site_dir: Path) -> Iterator[str]:
    """The built site over HTTP on 127.0.0.1 (a free port the kernel picks); yields its root URL."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-site", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class _PageLinks(HTMLParser):
    """One page's ids (what a #fragment may name) and its links to files, each with its line."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[tuple[int, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)
            if (tag, name) in LINK_ATTRIBUTES:
                self.links.append((self.getpos()[0], value))


class _NavLinks(HTMLParser):
    """The links inside Material's site nav (`nav.md-nav--primary`, the page's own table of contents nested
    in it included)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth = 0  # open <nav> elements inside the primary nav, itself included
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if tag == "nav" and (self.depth or "md-nav--primary" in (values.get("class") or "").split()):
            self.depth += 1
        elif tag == "a" and self.depth and values.get("href"):
            self.links.append(values["href"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "nav" and self.depth:
            self.depth -= 1


def nav_links(page: Path) -> list[str]:
    """The hrefs of a built page's site nav, as written in its HTML (relative to the page)."""
    parsed = _NavLinks()
    parsed.feed(page.read_text(encoding="utf-8"))
    parsed.close()
    return parsed.links


def _parse(page: Path) -> _PageLinks:
    parsed = _PageLinks()
    parsed.feed(page.read_text(encoding="utf-8"))
    parsed.close()
    return parsed


def _target(site_dir: Path, url_path: str) -> Path:
    """The file a same-site URL path is served from (a folder's index.html), or the path as given."""
    relative = unquote(url_path).lstrip("/")
    target = site_dir / relative
    return target / "index.html" if relative == "" or url_path.endswith("/") or target.is_dir() else target


def broken_links(site_dir: Path) -> tuple[int, list[str]]:
    """Every same-site link of every built page checked: its file exists inside the site and its #anchor is
    an id on the target page. Returns how many links were checked and one line per broken one."""
    site_dir = site_dir.resolve()
    pages = sorted(site_dir.rglob("*.html"))
    parsed = {page: _parse(page) for page in pages}
    checked, problems = 0, []
    for page, links in parsed.items():
        page_url = "/" + page.relative_to(site_dir).as_posix()
        for line, href in links.links:
            parts = urlsplit(urljoin(page_url, href))
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:", "data:")):
                continue  # another site: not this check's to judge
            checked += 1
            where = f"{page.relative_to(site_dir)}:{line}: {href!r}"
            target = _target(site_dir, parts.path).resolve()
            if not target.is_relative_to(site_dir):
                problems.append(f"{where} leads outside the site")
            elif not target.is_file():
                problems.append(f"{where} leads to a missing file {target.relative_to(site_dir)}")
            elif parts.fragment and target.suffix == ".html":
                ids = parsed[target].ids if target in parsed else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    problems.append(f"{where}: no id {parts.fragment!r} on {target.relative_to(site_dir)}")
    return checked, problems
