"""reference/chart-values.md: every value of the Helm chart, from the schema kvtune.helm.values renders
values.schema.json from (in memory, so the page does not wait on the file being written first), with the
defaults the chart ships in helm/kvtune/values.yaml."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvtune.documents import read_yaml
from kvtune.helm.build import CHART_DIR
from kvtune.helm.values import values_schema
from kvtune.reference import markdown, model_fields, schema_text

SOURCE = "kvtune/helm/values.py (values.schema.json) and helm/kvtune/values.yaml"
VALUES_FILE = CHART_DIR / "values.yaml"
HEADER = ("Key", "Type", "Default", "Bounds", "Description")
# A path naming no single place in values.yaml (a list's item, a map's entry) has no default there.
_NOT_IN_FILE = (model_fields.LIST_ITEM, model_fields.MAP_ENTRY)


def key_paths(schema: schema_text.Schema, path: str = "") -> Iterator[tuple[str, schema_text.Schema]]:
    """(key path, its schema) of every key SCHEMA describes, each before the keys inside it: `engine`,
    `engine.maxModelLen`, `engines[].model`, ..."""
    for name, child in schema.get("properties", {}).items():
        child_path = f"{path}.{name}" if path else name
        yield child_path, child
        for step, inner in _objects_inside(child):
            yield from key_paths(inner, child_path + step)


def _objects_inside(node: schema_text.Schema) -> list[tuple[str, schema_text.Schema]]:
    """The object schemas NODE holds keys through: itself, an option of its anyOf (a section or null), its
    items (`[]`) or its map's values (`.<key>`)."""
    if "properties" in node:
        return [("", node)]
    found = [
        ("", option)
        for option in node.get("anyOf", [])
        if isinstance(option, dict) and "properties" in option
    ]
    for key, step in (("items", model_fields.LIST_ITEM), ("additionalProperties", model_fields.MAP_ENTRY)):
        inner = node.get(key)
        if isinstance(inner, dict):
            found += [(step + more, schema) for more, schema in _objects_inside(inner)]
    return found


def render(values_file: Path = VALUES_FILE) -> str:
    schema = values_schema()
    shipped = read_yaml(values_file)
    lines = markdown.page_head(
        "Chart values",
        "Every value of kvtune's Helm chart (`helm/kvtune`): its key path, type, default (as "
        "`helm/kvtune/values.yaml` ships it), bounds and meaning.",
        SOURCE,
    )
    top = list(schema.get("properties", {}))
    lines += [
        "`values.schema.json` checks every key: a misspelled key or a value outside its bounds fails "
        "`helm install` with its path. The `engine` section is the [engine profile](profile.md) under "
        "camelCase names.",
        "",
        "Sections: "
        + ", ".join(markdown.link(markdown.code(name), markdown.anchor(name)) for name in top)
        + ".",
        "",
    ]
    paths = list(key_paths(schema))
    for name in top:
        rows = [
            _row(path, node, shipped)
            for path, node in paths
            if path == name or path.startswith((f"{name}.", f"{name}["))
        ]
        lines += [
            markdown.heading(2, markdown.code(name), markdown.anchor(name)),
            "",
            *markdown.table(HEADER, rows),
            "",
        ]
    return markdown.page(lines)


def _row(path: str, node: schema_text.Schema, shipped: Any) -> list[str]:
    removed = node.get("deprecated") is True
    return [
        markdown.code(path),
        "removed" if removed else markdown.cell(schema_text.type_text(node)),
        markdown.cell(_default(path, node, shipped)),
        "" if removed else markdown.cell(schema_text.bounds_text(node)),
        markdown.cell(str(node.get("description", ""))),
    ]


def _default(path: str, node: schema_text.Schema, shipped: Any) -> str:
    """What values.yaml sets PATH to, else the schema's default; none for a section (its keys say theirs)."""
    if _objects_inside(node) and not any(step for step, _schema in _objects_inside(node)):
        return ""
    found, value = _lookup(shipped, path)
    if not found:
        if "default" not in node:
            return ""
        value = node["default"]
    text = schema_text.value_text(value)
    return f"`{text}`" if text else '`""`'


def _lookup(values: Any, path: str) -> tuple[bool, Any]:
    if any(mark in path for mark in _NOT_IN_FILE):
        return False, None
    node = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node
