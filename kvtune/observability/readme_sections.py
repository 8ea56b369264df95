"""Generated sections of a Markdown file, between `<!-- NAME:start -->` and `<!-- NAME:end -->` markers.

The README's panel tables and alert runbook are produced from the same code as the dashboards and the
rules; a test compares the committed text with a fresh rendering, so the two cannot drift.
"""

from __future__ import annotations

import re


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def section(text: str, name: str) -> str:
    """The body between NAME's markers; ValueError when the markers are missing."""
    start, end = markers(name)
    found = re.search(re.escape(start) + r"\n(.*?)" + re.escape(end), text, flags=re.DOTALL)
    if found is None:
        raise ValueError(f"no '{start}' ... '{end}' section")
    return found.group(1)


def replace_section(text: str, name: str, body: str) -> str:
    """TEXT with NAME's section replaced by BODY (a trailing newline is added when missing)."""
    section(text, name)  # raises when the markers are missing
    start, end = markers(name)
    body = body if body.endswith("\n") else body + "\n"
    return re.sub(
        re.escape(start) + r"\n.*?" + re.escape(end),
        lambda _: f"{start}\n{body}{end}",
        text,
        count=1,
        flags=re.DOTALL,
    )
