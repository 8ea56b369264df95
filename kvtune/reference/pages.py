"""The reference pages by file name (docs/reference/NAME) and the function rendering each."""

from __future__ import annotations

from collections.abc import Callable

from kvtune.reference import chart_values, cli, metrics, observability, profile_fields, spec_fields

# In the site's order (mkdocs.yml's nav lists them the same way).
PAGES: dict[str, Callable[[], str]] = {
    "cli.md": cli.render,
    "profile.md": profile_fields.render,
    "sweep-spec.md": spec_fields.render,
    "chart-values.md": chart_values.render,
    "metrics.md": metrics.render,
    "dashboards.md": observability.dashboards_page,
    "alerts.md": observability.alerts_page,
}


def render_all() -> dict[str, str]:
    """Each page's file name and its text."""
    return {name: render() for name, render in PAGES.items()}
