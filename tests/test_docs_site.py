"""The documentation site as a reader meets it: built with `mkdocs build --strict` as `make docs` builds it,
served on 127.0.0.1, opened in real Chromium. The home page, a guide and a reference page render; the nav
and the search box lead to pages; every page of the agreed site map is built and in the nav; every same-site
link of every built page resolves to a file and an id. No engine starts.

Screenshots of the home page and the slow-first-token guide go to test-artifacts/docs/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Route

from tests.browser import BrowserPage, open_browser
from tests.docs_site import broken_links, build_problems, build_site, nav_links, serving
from tests.helpers import ARTIFACTS

pytestmark = pytest.mark.timeout(300)

SCREENSHOTS = ARTIFACTS / "docs"

# The agreed site map: every page mkdocs.yml's nav names, as the folder mkdocs builds it into.
SITE_MAP = [
    "",
    "getting-started/install/",
    "getting-started/demo/",
    "getting-started/report/",
    "getting-started/serve/",
    "guides/slow-first-tokens/",
    "guides/own-traffic/",
    "guides/fleet/",
    "guides/kubernetes/",
    "guides/gpu-sweep/",
    "guides/routing/",
    "concepts/kv-arithmetic/",
    "concepts/goodput/",
    "concepts/validation/",
    "concepts/hit-rate-curve/",
    "reference/cli/",
    "reference/profile/",
    "reference/sweep-spec/",
    "reference/chart-values/",
    "reference/metrics/",
    "reference/dashboards/",
    "reference/alerts/",
    "benchmarks/",
    "develop/architecture/",
    "develop/tests/",
]
GUIDE = "guides/slow-first-tokens/"
GUIDE_TITLE = "Why are my first tokens slow?"
# A word of the guide's title: the search box must offer the guide for it.
SEARCH_WORD = "slow"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built once for the module; a warning fails the build (--strict) and so every test here."""
    site_dir = tmp_path_factory.mktemp("docs") / "site"
    problems = build_problems(build_site(site_dir))
    assert problems is None, f"`mkdocs build --strict` failed:\n{problems}"
    return site_dir


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    with serving(site) as url:
        yield url


@pytest.fixture(scope="module")
def browser(site_url: str) -> Iterator[BrowserPage]:
    """One Chromium tab that reaches the served site only: a request elsewhere (a web font, say) is refused
    at once, so a page renders the same on a closed network and no test waits on the internet."""

    def same_site_only(route: Route) -> None:
        if route.request.url.startswith(site_url):
            route.continue_()
        else:
            route.abort()

    with open_browser() as page:
        page.raw.route("**/*", same_site_only)
        yield page


def open_page(page: BrowserPage, url: str) -> None:
    response = page.raw.goto(url, wait_until="load", timeout=page.timeout_s * 1000)
    assert response is not None and response.status == 200, f"{url}: {response and response.status}"


def heading(page: BrowserPage) -> str:
    """The page's h1 without the permalink mark the toc extension adds."""
    return page.text("article h1").replace("¶", "").strip()


@pytest.mark.parametrize(
    ("path", "title", "words", "screenshot"),
    [
        ("", None, ["kvtune"], "home.png"),
        (GUIDE, GUIDE_TITLE, ["TTFT"], "slow-first-tokens.png"),
        ("reference/profile/", None, ["kv_cache_dtype", "max_model_len"], None),
    ],
    ids=["home", "guide", "reference"],
)
def test_a_page_renders(
    browser: BrowserPage,
    site_url: str,
    path: str,
    title: str | None,
    words: list[str],
    screenshot: str | None,
) -> None:
    open_page(browser, site_url + path)
    try:
        h1 = heading(browser)
        body = browser.text("article")
    finally:
        if screenshot:
            browser.screenshot(SCREENSHOTS / screenshot)
    assert h1 and "404" not in h1, h1
    if title is not None:
        assert h1 == title
    assert len(body) > 300, body
    for word in words:
        assert word in body, f"{word!r} not on {path or 'the home page'}"
    if screenshot:
        assert (SCREENSHOTS / screenshot).stat().st_size > 10_000


def test_the_nav_leads_to_a_guide(browser: BrowserPage, site_url: str) -> None:
    open_page(browser, site_url)
    browser.raw.locator(f'nav.md-nav--primary a.md-nav__link[href$="{GUIDE}"]').first.click()
    browser.raw.wait_for_url(re.compile(re.escape(GUIDE) + "$"), timeout=browser.timeout_s * 1000)
    assert heading(browser) == GUIDE_TITLE


def test_the_search_box_finds_a_guide(browser: BrowserPage, site_url: str) -> None:
    open_page(browser, site_url)
    box = browser.raw.locator("input.md-search__input")
    box.click()
    box.press_sequentially(SEARCH_WORD, delay=50)  # typed, key by key, as a reader types
    results = browser.raw.locator("a.md-search-result__link")

    def hrefs(page: BrowserPage) -> list[str]:
        found: list[str] = results.evaluate_all("links => links.map(link => link.href)")
        return found

    found = browser.wait_until(
        hrefs, lambda links: any(GUIDE in link for link in links), f"a result linking to {GUIDE}"
    )
    target = next(link for link in found if GUIDE in link)
    assert target.startswith(site_url), target
    browser.raw.locator(f'a.md-search-result__link[href*="{GUIDE}"]').first.click()
    browser.raw.wait_for_url(re.compile(re.escape(GUIDE)), timeout=browser.timeout_s * 1000)
    assert heading(browser) == GUIDE_TITLE


def test_every_page_of_the_site_map_is_built_and_in_the_nav(site: Path) -> None:
    missing = [page or "index" for page in SITE_MAP if not (site / page / "index.html").is_file()]
    assert not missing, f"pages not built: {missing}"
    nav = set(nav_links(site / "index.html"))
    not_in_nav = [page for page in SITE_MAP[1:] if page not in nav]
    assert not not_in_nav, f"pages the home page's nav does not link: {not_in_nav}"


def test_every_same_site_link_resolves(site: Path) -> None:
    checked, problems = broken_links(site)
    # Each built page links its nav, assets and headings: far more than this, unless nothing was crawled.
    assert checked > 50 * len(SITE_MAP), f"only {checked} links found: the crawl saw too little"
    distinct = list(dict.fromkeys(problems))  # a link repeated on one line is one problem
    shown = "\n".join(distinct[:40]) + (f"\n... and {len(distinct) - 40} more" if len(distinct) > 40 else "")
    assert not distinct, f"{len(distinct)} links lead nowhere:\n{shown}"


def test_the_link_check_finds_what_leads_nowhere(tmp_path: Path) -> None:
    """The crawl is only as good as what it catches: a small built site with one link of each kind."""
    (tmp_path / "guide").mkdir()
    (tmp_path / "guide" / "index.html").write_text('<h2 id="cause">Cause</h2>\n<a href="../">home</a>')
    (tmp_path / "index.html").write_text(
        "\n".join(
            [
                '<a href="guide/">fine</a> <a href="guide/#cause">fine</a> <a href="#top" id="top">fine</a>',
                '<a href="guide/#effect">no such id</a>',
                '<a href="missing/">no such page</a> <img src="images/plot.svg">',
                '<a href="../../etc/passwd">above the root</a>',
                '<a href="https://example.com/x">elsewhere</a> <a href="mailto:x@example.com">mail</a>',
            ]
        )
    )
    checked, problems = broken_links(tmp_path)
    assert checked == 8
    assert problems == [
        "index.html:2: 'guide/#effect': no id 'effect' on guide/index.html",
        "index.html:3: 'missing/' leads to a missing file missing/index.html",
        "index.html:3: 'images/plot.svg' leads to a missing file images/plot.svg",
        "index.html:4: '../../etc/passwd' leads to a missing file etc/passwd",  # a browser stops at the root
    ], problems
