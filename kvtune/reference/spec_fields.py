"""reference/sweep-spec.md: every field of a sweep spec, one table per section (the spec's top level, then
each nested section in document order), read from `SweepSpec` and the models it holds."""

from __future__ import annotations

from kvtune.reference import markdown, model_fields
from kvtune.sweep.spec import KNOBS, SweepSpec

SOURCE = "kvtune/sweep/spec.py"


def render() -> str:
    sections = model_fields.sections(SweepSpec)
    lines = markdown.page_head(
        "Sweep spec",
        "Every field of a sweep spec (the YAML file `kvtune sweep` reads), one table per section: its type, "
        "default, bounds and meaning.",
        SOURCE,
    )
    # The knobs are profile fields: each links to its entry on the profile page (a page beside this one).
    knobs = ", ".join(f"[{markdown.code(name)}](profile.md#{markdown.anchor(name)})" for name in KNOBS)
    lines += [
        "A spec is strict: a key that is not a field below is refused with its path, and so is a value "
        f"outside a field's bounds. The knobs `space` may vary are these profile fields: {knobs}.",
        "",
        "Sections: "
        + ", ".join(markdown.link(_title(section), section.fragment) for section in sections)
        + ".",
        "",
    ]
    for section in sections:
        lines += model_fields.section_lines(section, 2, _title(section))
    return markdown.page(lines)


def _title(section: model_fields.Section) -> str:
    return markdown.code(section.path) if section.path else "Top level"
