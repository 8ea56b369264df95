"""A pydantic model's fields as reference tables, one per section (the model and each model nested in it, in
document order): field, type, default, bounds and description, read from the model's JSON Schema and its
FieldInfo. The sweep-spec page is made of them, and the profile page's nested items."""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from kvtune.reference import markdown, schema_text

# How a path names one entry of a map and of a list: `space.<key>`, `warmup[]`.
MAP_ENTRY = ".<key>"
LIST_ITEM = "[]"
TOP = "top-level"
HEADER = ("Field", "Type", "Default", "Bounds", "Description")


@dataclass(frozen=True)
class Section:
    """One model of a document, at the path it sits at (`""` for the document itself)."""

    path: str
    model: type[BaseModel]

    @property
    def fragment(self) -> str:
        """`validation-workload`, `space-entry`, `warmup-item`: apart from the anchor of the field itself."""
        if not self.path:
            return TOP
        return markdown.anchor(self.path.replace(LIST_ITEM, "-item").replace(MAP_ENTRY, "-entry"))


def nested_models(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The models ANNOTATION holds, each with the path step that reaches it from the field (`""`: the
    field's value itself, `[]`: a list's item, `.<key>`: a map's value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return nested_models(args[0])
    if origin in (list, tuple, set, frozenset):
        return [(LIST_ITEM + step, model) for arg in args for step, model in nested_models(arg)]
    if origin is dict and len(args) == 2:
        return [(MAP_ENTRY + step, model) for step, model in nested_models(args[1])]
    if origin in (typing.Union, types.UnionType):
        return [found for arg in args for found in nested_models(arg)]
    return []


def sections(model: type[BaseModel], path: str = "") -> list[Section]:
    """MODEL's section and every section nested in it, each after its parent, in the order of the fields
    that hold them (a YAML document's order)."""
    found = [Section(path, model)]
    for name, info in model.model_fields.items():
        for step, nested in nested_models(info.annotation):
            found += sections(nested, f"{path}.{name}{step}" if path else f"{name}{step}")
    return found


def walk_fields(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, str]]:
    """(section path, field name) of every field of MODEL and of the models nested in it."""
    for section in sections(model, path):
        for name in section.model.model_fields:
            yield section.path, name


def section_lines(section: Section, level: int, title: str | None = None) -> list[str]:
    """A section's heading (anchored), its model's docstring and its fields' table."""
    heading = title or markdown.code(section.path)
    lines = [markdown.heading(level, heading, section.fragment), ""]
    doc = section.model.__doc__  # a class's own: docstrings are not inherited
    if doc:
        lines += [" ".join(doc.split()), ""]
    return [*lines, *markdown.table(HEADER, field_rows(section)), ""]


def field_rows(section: Section) -> list[list[str]]:
    """Each field of SECTION's model: its name (linked to its own section when it has one), type, default,
    bounds and description."""
    schema = section.model.model_json_schema()
    definitions = schema.get("$defs", {})
    rows = []
    for name, info in section.model.model_fields.items():
        prop = schema["properties"][info.alias or name]
        nested = nested_models(info.annotation)
        label = markdown.code(name)
        if nested:
            step = nested[0][0]
            child = Section(f"{section.path}.{name}{step}" if section.path else f"{name}{step}", nested[0][1])
            label = markdown.link(label, child.fragment)
        rows.append(
            [
                label,
                markdown.cell(schema_text.type_text(prop, definitions)),
                markdown.cell(schema_text.default_text(info)),
                markdown.cell(schema_text.bounds_text(prop, definitions)),
                markdown.cell(description(prop, definitions)),
            ]
        )
    return rows


def description(prop: schema_text.Schema, definitions: schema_text.Schema) -> str:
    """A field's description; for a section field without one, its model docstring's first sentence (the
    section itself shows the rest)."""
    text = prop.get("description")
    if isinstance(text, str):
        return text
    for option in prop.get("anyOf", [prop]):
        resolved = schema_text.resolve(option, definitions)
        if isinstance(resolved.get("description"), str):
            first = " ".join(str(resolved["description"]).split()).split(". ", 1)[0]
            return first if first.endswith(".") else f"{first}."
    return ""
