"""reference/dashboards.md and reference/alerts.md: the dashboards' panel tables and the alert runbook, as
kvtune.observability renders them from the same code as the dashboards' JSON and the rules file."""

from __future__ import annotations

import re

from kvtune.observability import alerts, dashboards
from kvtune.reference import markdown

_FENCE = re.compile(r"^(```|~~~)")
# The renderings head each dashboard and alert at level 4 (they were written as subsections); on a page of
# their own each is a section.
_SECTION_LEVEL = 4


def promoted(text: str, by: int) -> str:
    """TEXT with every heading BY levels higher (`####` -> `##` for 2), code blocks left as they are."""
    lines = []
    in_code = False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            marks = len(line) - len(line.lstrip("#"))
            line = "#" * max(1, marks - by) + line[marks:]
        lines.append(line)
    return "\n".join(lines)


def _wrapped(title: str, summary: str, source: str, body: str) -> str:
    """A page around a rendering the observability modules already give, its headings raised to the page's."""
    return markdown.page([*markdown.page_head(title, summary, source), promoted(body, _SECTION_LEVEL - 2)])


def dashboards_page() -> str:
    return _wrapped(
        "Dashboards",
        "Every Grafana dashboard kvtune ships (`dashboards/*.json`, also in the Helm chart) and every panel "
        "on it, with its PromQL query and unit.",
        "kvtune/observability/dashboards.py",
        dashboards.panel_table_markdown(),
    )


def alerts_page() -> str:
    return _wrapped(
        "Alerts",
        "Every Prometheus alert rule kvtune ships: what it means, how it is computed, its query at the "
        "default TTFT SLO, and what to change when it fires.",
        "kvtune/observability/alerts.py",
        alerts.runbook_markdown(),
    )
