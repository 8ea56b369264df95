"""Real-browser helpers for tests: Debian's headless Chromium driven by Playwright, and Locust web-UI readers.

Playwright never downloads a browser here: it launches `/usr/bin/chromium` (installed by `make sysdeps`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

from playwright.sync_api import Page, sync_playwright

T = TypeVar("T")

CHROMIUM = Path("/usr/bin/chromium")
# --no-sandbox: CI runs as root. The rest keep Chromium from calling home: on a closed network its background
# services would otherwise retry refused connections for the whole test.
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

# Reads a whole table in one call: the page may re-render between two separate cell reads.
_TABLE_ROWS_JS = """(table) => {
    const text = (cell) => (cell.textContent || "").replace(/\\s+/g, " ").trim();
    const headers = Array.from(table.querySelectorAll("thead th")).map(text);
    return Array.from(table.querySelectorAll("tbody tr")).map((row) =>
        Object.fromEntries(
            Array.from(row.querySelectorAll("td")).map((cell, i) => [headers[i] ?? String(i), text(cell)])
        )
    );
}"""


class BrowserError(AssertionError):
    """A page did not show what a test waited for."""


class BrowserPage:
    """One open tab with the few verbs tests need; `raw` is the Playwright page for anything else."""

    def __init__(self, page: Page, timeout_s: float) -> None:
        self.raw = page
        self.timeout_s = timeout_s

    def _ms(self, timeout_s: float | None) -> float:
        return (self.timeout_s if timeout_s is None else timeout_s) * 1000

    def open(self, url: str, timeout_s: float | None = None) -> None:
        self.raw.goto(url, wait_until="load", timeout=self._ms(timeout_s))

    def wait_for_selector(self, selector: str, timeout_s: float | None = None) -> None:
        self.raw.locator(selector).first.wait_for(state="visible", timeout=self._ms(timeout_s))

    def wait_for_text(self, text: str, timeout_s: float | None = None) -> None:
        self.raw.get_by_text(text).first.wait_for(state="visible", timeout=self._ms(timeout_s))

    def text(self, selector: str = "body") -> str:
        return self.raw.locator(selector).first.inner_text(timeout=self._ms(None))

    def table_rows(self, table_selector: str = "table") -> list[dict[str, str]]:
        """The body rows of the first matching table, each keyed by its column header text."""
        rows = self.raw.locator(table_selector).first.evaluate(_TABLE_ROWS_JS, timeout=self._ms(None))
        return cast(list[dict[str, str]], rows)

    def wait_until(
        self,
        read: Callable[[BrowserPage], T],
        done: Callable[[T], bool],
        what: str,
        timeout_s: float | None = None,
    ) -> T:
        """Polls `read(self)` until `done` holds; fails with the last value read and `what` was awaited."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            value = read(self)
            if done(value):
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"timed out waiting for {what}; last read: {value!r}")
            self.raw.wait_for_timeout(250)

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.raw.screenshot(path=path, full_page=full_page)
        return path


@contextmanager
def open_browser(
    *, viewport: tuple[int, int] = (1400, 900), timeout_s: float = 30.0, chromium: Path = CHROMIUM
) -> Iterator[BrowserPage]:
    """Headless Chromium with a fresh profile; yields one page and closes everything on exit."""
    if not chromium.is_file():
        raise FileNotFoundError(f"{chromium} is missing: run `make sysdeps` (Debian package `chromium`)")
    width, height = viewport
    with tempfile.TemporaryDirectory(prefix="kvtune-chromium-") as profile, sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile,
            executable_path=chromium,
            headless=True,
            args=list(CHROMIUM_ARGS),
            viewport={"width": width, "height": height},
        )
        try:
            page = context.pages[0] if context.pages else context.new_page()
            yield BrowserPage(page, timeout_s)
        finally:
            context.close()


# Locust's web UI (a React app). Its statistics table is the one whose headers carry these sort keys.
LOCUST_STATS_TABLE = 'table:has(th[data-sortkey="method"]):has(th[data-sortkey="numRequests"])'


def locust_stats_rows(page: BrowserPage) -> list[dict[str, str]]:
    """The statistics tab's rows keyed by header ("Type", "Name", "# Requests", ...), with "Aggregated"."""
    return page.table_rows(LOCUST_STATS_TABLE)


def _count(row: dict[str, str]) -> int:
    digits = row.get("# Requests", "").replace(",", "")
    return int(digits) if digits.isdigit() else 0


def wait_for_locust_requests(
    page: BrowserPage, request_types: Sequence[str], timeout_s: float | None = None
) -> list[dict[str, str]]:
    """Waits until each request type has a stats row with a non-zero "# Requests"; returns all rows."""
    wanted = set(request_types)

    def done(rows: list[dict[str, str]]) -> bool:
        return wanted <= {row.get("Type", "") for row in rows if _count(row) > 0}

    return page.wait_until(
        locust_stats_rows, done, f"Locust rows of type {sorted(wanted)} with requests", timeout_s
    )


# The header's figures ("Host", "Status", "Users", "RPS", "Failures": each a label with its value beside it)
# and the statistics rows, read in one call: the page re-renders on every poll, and both must come from one.
_LOCUST_SNAPSHOT_JS = (
    """(tableSelector) => {
    const readRows = """
    + _TABLE_ROWS_JS
    + """;
    const text = (el) => (el.textContent || "").replace(/\\s+/g, " ").trim();
    const header = {};
    for (const label of document.querySelectorAll("header p")) {
        if (!label.previousElementSibling && label.nextElementSibling) {
            header[text(label)] = text(label.nextElementSibling);
        }
    }
    const table = document.querySelector(tableSelector);
    return {header, rows: table ? readRows(table) : []};
}"""
)


@dataclass(frozen=True)
class LocustSnapshot:
    header: dict[str, str]
    rows: list[dict[str, str]]


def locust_snapshot(page: BrowserPage) -> LocustSnapshot:
    """The header's label -> value pairs and the statistics rows, as shown at one moment."""
    data = page.raw.evaluate(_LOCUST_SNAPSHOT_JS, LOCUST_STATS_TABLE)
    return LocustSnapshot(
        header=cast(dict[str, str], data["header"]), rows=cast(list[dict[str, str]], data["rows"])
    )


def open_locust_tab(page: BrowserPage, title: str) -> None:
    """Switch the Locust web UI to the tab titled `title` (built-in or added by a locustfile)."""
    page.raw.get_by_role("tab", name=title).click(timeout=page._ms(None))
