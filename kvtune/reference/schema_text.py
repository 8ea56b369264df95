"""A field's type, bounds and default in words, read from its JSON Schema and its pydantic FieldInfo: what
the profile, sweep-spec and chart-values pages write in their columns, so the three say it alike."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined, to_jsonable_python

from kvtune.profile.argv_text import NO_VARIABLE_REFERENCE

Schema = dict[str, Any]

# JSON Schema's words for a bound, and how the page says each.
_BOUNDS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} characters"),
    ("maxLength", "at most {} characters"),
    ("minItems", "at least {} items"),
    ("maxItems", "at most {} items"),
)
# Factories whose value is the same on every host, as a document writes it; others (the detected device)
# are named, never called: the page must not depend on the host that renders it.
_PLAIN_FACTORIES: dict[Any, str] = {list: "[]", tuple: "[]", set: "[]", frozenset: "[]", dict: "{}"}
# The profile's rule on text that reaches a command line, as its pattern; said in words instead.
NO_VARIABLE_REFERENCE_TEXT = "no `$(`"


def resolve(schema: Schema, definitions: Schema) -> Schema:
    """SCHEMA with a `$ref` to DEFINITIONS (the document's `$defs`) replaced by what it names."""
    ref = schema.get("$ref")
    if not isinstance(ref, str):
        return schema
    target = definitions[ref.rsplit("/", 1)[-1]]
    rest = {key: value for key, value in schema.items() if key != "$ref"}
    return {**resolve(target, definitions), **rest}


def _options(schema: Schema) -> list[Schema]:
    options = schema.get("anyOf") or schema.get("oneOf")
    return list(options) if isinstance(options, list) else [schema]


def type_text(schema: Schema, definitions: Schema | None = None) -> str:
    """e.g. `integer or null`, `list of string`, `map of string to string`, `object (WarmupPrefix)`."""
    definitions = definitions or {}
    words: list[str] = []
    for option in _options(schema):
        words += _type_words(option, definitions)
    return " or ".join(dict.fromkeys(words)) or "any"


def _type_words(schema: Schema, definitions: Schema) -> list[str]:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return [f"object ({ref.rsplit('/', 1)[-1]})"]
    if "anyOf" in schema or "oneOf" in schema:
        return type_text(schema, definitions).split(" or ")
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return list(dict.fromkeys(_json_type(value) for value in values))
    kinds = schema.get("type")
    if kinds is None:
        return ["any"]
    words = []
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind == "array":
            items = schema.get("items")
            words.append(f"list of {type_text(items, definitions)}" if isinstance(items, dict) else "list")
        elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
            words.append(f"map of string to {type_text(schema['additionalProperties'], definitions)}")
        elif kind == "string" and schema.get("format") == "path":
            words.append("path")
        else:
            words.append(str(kind))
    return words


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def bounds_text(schema: Schema, definitions: Schema | None = None) -> str:
    """The values SCHEMA admits beyond its type, in words: `> 0`, `≤ 65535`, `one of auto, fp8`, `no $(`;
    a list's or a map's rules on each entry too. Markdown (code spans), for `markdown.cell`."""
    definitions = definitions or {}
    said: list[str] = []
    for option in _options(schema):
        said += _bounds(resolve(option, definitions), definitions)
    return "; ".join(dict.fromkeys(said))


def _bounds(schema: Schema, definitions: Schema) -> list[str]:
    said = [template.format(_number(schema[key])) for key, template in _BOUNDS if key in schema]
    values = schema.get("enum")
    if isinstance(values, list):
        said.append("one of " + ", ".join(_value(value) for value in values if value is not None))
    if "const" in schema:
        said.append("only " + _value(schema["const"]))
    patterns = [schema.get("pattern")] + [rule.get("pattern") for rule in schema.get("allOf", [])]
    for pattern in patterns:
        if pattern == NO_VARIABLE_REFERENCE:
            said.append(NO_VARIABLE_REFERENCE_TEXT)
        elif isinstance(pattern, str):
            said.append(f"matches {_code(pattern)}")
    for key, what in (("items", "each item"), ("additionalProperties", "each value")):
        inner = schema.get(key)
        if isinstance(inner, dict) and not ("$ref" in inner or "properties" in resolve(inner, definitions)):
            inner_bounds = bounds_text(inner, definitions)
            if inner_bounds:
                said.append(f"{what}: {inner_bounds}")
    return said


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _value(value: Any) -> str:
    return _code(value if isinstance(value, str) else json.dumps(value))


def _code(text: str) -> str:
    # A span fenced by more backticks than it holds (markdown.cell turns it into <code> when needed).
    return f"`{text}`"


def value_text(value: Any) -> str:
    """A default as YAML/JSON writes it: `null`, `true`, `8000`, `"engine"` as engine, `[]`."""
    plain = to_jsonable_python(value)
    if isinstance(plain, str):
        return plain
    return json.dumps(plain, ensure_ascii=False)


def default_text(info: FieldInfo) -> str:
    """FIELD's default for the page (Markdown): its value as code, `required`, what a host-dependent
    factory is named, or that a section's own defaults apply."""
    if info.default is not PydanticUndefined:
        return _code_cell(value_text(info.default))
    factory = info.default_factory
    if factory is None:
        return "required"
    if isinstance(factory, type) and issubclass(factory, BaseModel):
        return "its fields' defaults"
    if factory in _PLAIN_FACTORIES:
        return _code_cell(_PLAIN_FACTORIES[factory])
    name = getattr(factory, "__name__", "<lambda>")
    return "computed when the document is read" if name == "<lambda>" else f"computed by `{name}()`"


def _code_cell(text: str) -> str:
    return f"`{text}`" if text else '`""`'
