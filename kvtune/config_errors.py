"""Errors in the documents kvtune is given: every mistake becomes one line naming the field and the fix.

Reading a document (a regular file, YAML 1.2, bounded) is kvtune.documents' job; this module says what is
wrong with what was read."""

from __future__ import annotations

import difflib
import math
import reprlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

M = TypeVar("M", bound=BaseModel)

# Inputs are quoted in messages; a 5 MB string or a recursive list must still make one short line.
_BRIEF = reprlib.Repr()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlist = _BRIEF.maxdict = _BRIEF.maxset = _BRIEF.maxtuple = 6
_BRIEF.maxlevel = 3
# A space of 10,000 unusable values must not print 10,000 lines: the first ones say what to fix.
MAX_LINES = 25
# Nor may one line be a page: a check that quotes a value it was given is cut here.
MAX_LINE_CHARS = 400


class ConfigError(Exception):
    """A configuration file that cannot be used; str() is the full, user-facing explanation."""


class DocumentError(ConfigError):
    """A document (a file kvtune reads) that cannot be used.

    str() may quote the document, which helps its author; `summary` says what is wrong without quoting it
    (a line and column, a field name, a count), so a document that names this one, as a sweep spec names its
    base profile, reports it without showing another file's content: a secrets file named by mistake stays
    unprinted.
    """

    def __init__(self, message: str, *, path: str | Path, summary: str) -> None:
        super().__init__(message)
        self.path = str(path)
        self.summary = summary


def cut(text: str, limit: int = MAX_LINE_CHARS) -> str:
    """`text` on at most `limit` characters, marked where it was cut."""
    return text if len(text) <= limit else text[: limit - 5] + " [...]"


def format_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def brief(value: object) -> str:
    """A short repr of any input, even one whose repr is huge, recursive or raises."""
    if isinstance(value, int) and value.bit_length() > 200:  # repr() refuses ints beyond 4,300 digits
        return f"<an integer of about {round(value.bit_length() * math.log10(2)):,} digits>"
    try:
        return _BRIEF.repr(value)
    except Exception:  # noqa: BLE001 - a broken repr must not replace the error it describes
        return f"<{type(value).__name__}>"


# ---- where an error is: the user's field path, without pydantic's union-member tags ----------------------


def _members(annotation: Any) -> list[Any]:
    """The alternatives of a Union/Optional/Annotated annotation (itself when it is none of those)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            out += [] if arg is type(None) else _members(arg)
        return out
    return [annotation]


def _is_model(annotation: Any) -> bool:
    # `list[int]` passes isinstance(..., type) but not issubclass: generic aliases are ruled out first.
    plain_class = isinstance(annotation, type) and not typing.get_args(annotation)
    return plain_class and issubclass(annotation, BaseModel)


def _tag_matches(tag: str, member: Any) -> bool:
    """Whether pydantic's union tag (`Range`, `function-after[_ordered(), Range]`, `list[any]`) names it."""
    if _is_model(member):
        name: str = member.__name__
        return tag == name or tag.endswith((f", {name}]", f"[{name}]"))
    origin = typing.get_origin(member) or member
    return isinstance(origin, type) and tag.split("[", 1)[0] == origin.__name__


def _step(annotation: Any, part: int | str) -> tuple[Any, bool] | None:
    """The annotation one `loc` part further down, and whether that part was a union tag (not user data)."""
    members = _members(annotation)
    if isinstance(part, str) and len(members) > 1:
        chosen = [m for m in members if _tag_matches(part, m)]
        if chosen:
            return chosen[0], True
    for member in members:
        if _is_model(member):
            field = member.model_fields.get(str(part))
            if field is not None:
                return field.annotation, False
            continue
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin is dict and len(args) == 2:
            return (args[0] if part == "[key]" else args[1]), False
        if origin in (list, tuple, set, frozenset) and args and isinstance(part, int):
            return args[0], False
    return None


@dataclass(frozen=True)
class _Where:
    path: tuple[int | str, ...]  # the user's path: field names, indices and keys
    fields: tuple[str, ...]  # field names of the model holding the last part (for unknown-field hints)
    union_at: int | None = None  # length of `path` where the innermost union member was chosen
    member: str | None = None  # pydantic's tag of that member


def _locate(model: type[BaseModel], loc: tuple[int | str, ...]) -> _Where:
    annotation: Any = model
    path: list[int | str] = []
    union_at, member = None, None
    for index, part in enumerate(loc):
        last = index == len(loc) - 1
        step = None if annotation is None else _step(annotation, part)
        if step is not None and step[1]:
            annotation, union_at, member = step[0], len(path), str(part)
            continue
        if last:
            holders = [m for m in _members(annotation) if _is_model(m)] if annotation is not None else []
            fields = tuple(holders[0].model_fields) if holders else ()
            return _Where((*path, part), fields, union_at, member)
        path.append(part)
        annotation = None if step is None else step[0]
    return _Where(tuple(path), (), union_at, member)


def _path_text(path: tuple[int | str, ...]) -> str:
    if path and path[-1] == "[key]":
        return f"{format_loc(path[:-1])} (the key)"
    return format_loc(path)


# ---- the message ------------------------------------------------------------------------------------------


def _line(err: Any, where: _Where) -> str:
    text = _path_text(where.path)
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    kind = err.get("type")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(where.path[-1]), where.fields, n=1) if where.path else []
        if close:
            hint = f"did you mean '{close[0]}'?"
        elif where.fields:
            hint = f"known fields: {', '.join(where.fields)}"
        else:
            hint = "remove it"
        return f"{text}: unknown field; {hint}"
    if kind == "missing":
        return f"{text}: required field is missing; add it"
    if kind in ("value_error", "assertion_error"):
        # Whole-document checks name their fields in the message itself.
        return f"{text}: {msg}" if text else msg
    return f"{text or 'document'}: {brief(err.get('input'))} is not valid: {msg}"


def _is_shape_mismatch(err: Any) -> bool:
    """The value is not even of the member's kind (a mapping given for a list): that member was not meant."""
    kind = str(err.get("type", ""))
    return kind.endswith("_type") or kind == "is_instance_of"


def _drop_unchosen_union_members(located: list[tuple[Any, _Where]]) -> list[tuple[Any, _Where]]:
    """A value failing every member of a union reports each one; when the value has the shape of one member
    (its errors lie deeper, or say more than "not a list"), only that member's errors say what to fix."""
    chosen: dict[tuple[int | str, ...], set[str | None]] = {}
    for err, where in located:
        if where.union_at is not None and (len(where.path) > where.union_at or not _is_shape_mismatch(err)):
            chosen.setdefault(where.path[: where.union_at], set()).add(where.member)
    return [
        (err, where)
        for err, where in located
        if where.union_at is None or where.member in chosen.get(where.path[: where.union_at], {where.member})
    ]


def format_validation_errors(exc: ValidationError, model: type[BaseModel], source: str) -> str:
    """One line per problem, each naming the field's full path (`space.kv_cache_dtype[2]`) and the fix."""
    located = []
    for err in exc.errors(include_url=False):
        try:
            where = _locate(model, tuple(err["loc"]))
        except Exception:  # noqa: BLE001 - an odd schema must not turn the user's error into a traceback
            where = _Where(tuple(err["loc"]), ())
        located.append((err, where))
    lines: list[str] = []
    for err, where in _drop_unchosen_union_members(located):
        line = _line(err, where)
        previous = lines[-1] if lines else ""
        prefix = f"{_path_text(where.path)}: {brief(err.get('input'))} is not valid: "
        if where.union_at is not None and previous.startswith(prefix) and line.startswith(prefix):
            lines[-1] = f"{previous}, or {line.removeprefix(prefix)}"  # one line per value, not per member
        else:
            lines.append(line)
    shown = [cut(line) for line in "\n".join(lines).splitlines()]  # a check may report one problem a line
    if len(shown) > MAX_LINES:
        shown = [*shown[: MAX_LINES - 1], f"... and {len(shown) - MAX_LINES + 1:,} more problems"]
    return f"{source}: invalid {model.__name__}:\n  " + "\n  ".join(line.strip() for line in shown)


# ---- files ------------------------------------------------------------------------------------------------


def path_problem(path: Path) -> str | None:
    """Why `path` cannot be a file a document names, or None; never raises (a name too long, a NUL byte)."""
    try:
        if path.is_file():
            return None
        if path.is_dir():
            return "is a folder, not a file"
        return "does not exist"
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, a loop of links
        return f"cannot be used ({getattr(exc, 'strerror', None) or exc})"


def existing_file(value: Path, info: ValidationInfo, what: str) -> Path:
    """A path from a document, relative to the document's folder, that must name an existing file."""
    base = (info.context or {}).get("base_dir")
    path = value if value.is_absolute() or base is None else Path(base) / value
    problem = path_problem(path)
    if problem:
        raise ValueError(f"{what} {str(path)!r} {problem}; fix the path (relative to this file's folder)")
    return path


def _fields_at_fault(exc: ValidationError, model: type[BaseModel]) -> str:
    """Which of the model's own fields failed, and how many problems: names from the schema, never a key or
    a value from the document."""
    names: list[str] = []
    unknown = 0
    for err in exc.errors(include_url=False):
        first = err["loc"][0] if err["loc"] else None
        if first is None:
            name = "a check across fields"
        elif isinstance(first, str) and first in model.model_fields and err["type"] != "extra_forbidden":
            name = first
        else:
            unknown += 1
            continue
        if name not in names:
            names.append(name)
    if unknown:
        names.append("an unknown field" if unknown == 1 else f"{unknown} unknown fields")
    count = len(exc.errors())
    return f"{count} problem{'s' if count > 1 else ''} ({', '.join(names)})"


def validate(model: type[M], data: Any, source: str, context: dict[str, Any] | None = None) -> M:
    """`data` as `model`; DocumentError naming `source` (and a content-free summary) when it is not one."""
    if not isinstance(data, dict):
        kind = "a list" if isinstance(data, list) else "a single value"
        raise DocumentError(
            f"{source}: expected a mapping of {model.__name__} fields (name: value per line), got "
            + (kind if isinstance(data, list) else f"{kind} ({brief(data)})"),
            path=source,
            summary=f"holds {kind}, not a mapping of {model.__name__} fields",
        )
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise DocumentError(
            format_validation_errors(exc, model, source),
            path=source,
            summary=f"not a valid {model.__name__}: {_fields_at_fault(exc, model)}",
        ) from exc
    except DocumentError as exc:  # a document this one names (a sweep's base profile) cannot be used
        # Only the summary: the other file may be anything (a secrets file named by mistake), and its text
        # must not appear in this document's error.
        raise DocumentError(
            f"{source}: {exc.path} (named in it) cannot be used: {exc.summary}; fix that file or name "
            "another",
            path=source,
            summary=f"{exc.path}, which it names, cannot be used",
        ) from None
    except ConfigError as exc:  # a check that reads further input (a model's config.json) refused it
        raise DocumentError(f"{source}: {exc}", path=source, summary=cut(str(exc))) from exc


# ---- the base of every document model -----------------------------------------------------------------


def _admits_bool(annotation: Any) -> bool:
    """Whether a field typed `annotation` may hold a boolean (bool, Any, or a Literal of one)."""
    for member in _members(annotation):
        if member is bool or member is Any or member is object:
            return True
        if typing.get_origin(member) is typing.Literal and any(
            isinstance(a, bool) for a in typing.get_args(member)
        ):
            return True
    return False


def _admits_number(annotation: Any) -> bool:
    """Whether a field typed `annotation` holds numbers (int, float, ByteSize), or a list of them."""
    for member in _members(annotation):
        if typing.get_origin(member) in (list, tuple, set, frozenset):
            if any(_admits_number(arg) for arg in typing.get_args(member) if arg is not Ellipsis):
                return True
        elif isinstance(member, type) and issubclass(member, (int, float)) and member is not bool:
            return True
    return False


class DocumentModel(BaseModel):
    """Base of every model a YAML document is read into: unknown keys refused, every number finite, and a
    boolean never taken for a number (pydantic's lax mode reads `port: true` as 1 and `max_num_seqs: [2,
    true]` as [2, 1])."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        annotation = cls.model_fields[info.field_name].annotation
        items = value if isinstance(value, list) else [value]
        has_boolean = any(isinstance(item, bool) for item in items)
        if has_boolean and _admits_number(annotation) and not _admits_bool(annotation):
            raise ValueError("true/false is a boolean where a number belongs; write the number")
        return value
