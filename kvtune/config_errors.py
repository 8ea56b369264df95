"""Load YAML documents into typed models; every mistake becomes one line naming the field and the fix."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError, ValidationInfo

M = TypeVar("M", bound=BaseModel)


class ConfigError(Exception):
    """A configuration file that cannot be used; str() is the full, user-facing explanation."""


def format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the (possibly nested) model that holds the last element of `loc`."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        args = getattr(annotation, "__args__", ()) or (annotation,)
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            return []
        current = nested[0]
    return list(getattr(current, "model_fields", {}))


def format_validation_errors(exc: ValidationError, model: type[BaseModel], source: str) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = format_loc(loc)
        if err["type"] == "extra_forbidden":
            known = _fields_at(model, loc)
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known fields: {', '.join(known)}"
            lines.append(f"{where}: unknown field; {hint}")
            continue
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "missing":
            lines.append(f"{where}: required field is missing; add it")
        elif err["type"] in ("value_error", "assertion_error"):
            # Whole-document checks name their fields in the message itself.
            lines.append(f"{where}: {msg}" if where else msg)
        else:
            lines.append(f"{where}: {err.get('input')!r} is not valid: {msg}")
    return f"{source}: invalid {model.__name__}:\n  " + "\n  ".join(lines)


def existing_file(value: Path, info: ValidationInfo, what: str) -> Path:
    """A path from a document, relative to the document's folder, that must name an existing file."""
    base = (info.context or {}).get("base_dir")
    path = value if value.is_absolute() or base is None else Path(base) / value
    if not path.is_file():
        raise ValueError(
            f"{what} {str(path)!r} does not exist; fix the path (relative to this file's folder)"
        )
    return path


def read_yaml(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc


def validate(model: type[M], data: Any, source: str, context: dict[str, Any] | None = None) -> M:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of fields, got {type(data).__name__}")
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(format_validation_errors(exc, model, source)) from exc


def load_yaml_model(model: type[M], path: Path) -> M:
    """Read `path` as YAML and validate it; relative paths inside resolve against the file's folder."""
    return validate(model, read_yaml(path), str(path), context={"base_dir": path.parent})
