"""Read the documents kvtune is given (profiles, sweep specs, a model's config.json, replay traces) strictly.

A document is a regular file of bounded size (or a pipe a program writes it to, as `kvtune render
<(generate)` passes): a FIFO nobody writes to, a device, a socket or a folder named by mistake is refused at
once, never read forever. YAML is read as YAML 1.2's core schema, so `on`, `yes` and `1:30:00` stay text and
`010` is ten (YAML 1.1 made them true, true, 5400 and eight, silently); a key written twice, an alias loop,
and aliases that expand past what any profile or spec holds (a 1 KB "billion laughs" document is 10**9
values) are refused with the line. Every refusal is a DocumentError naming the file and the fix, with a
summary that quotes nothing from the file.

Why PyYAML with its own resolvers and composer rather than a YAML 1.2 library: ruamel.yaml reads 1.2 and
refuses duplicate keys, but it is a second, much larger YAML stack beside the PyYAML the project already uses,
and it shares aliased nodes without bounding their expansion either, so the counting below would be needed
anyway. The 1.2 core schema is four regular expressions and three small constructors.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import select
import stat
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar, NoReturn, TypeVar, cast

import yaml
from pydantic import BaseModel
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import BaseResolver
from yaml.scanner import Scanner

from kvtune.config_errors import DocumentError, brief, cut, validate

M = TypeVar("M", bound=BaseModel)

# Profiles and specs are a few hundred bytes, a model's config.json a few KB; reading stops here, so a disk
# image given by mistake is refused instead of filling memory.
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
# A profile or spec holds a few hundred values. Counted with every alias expanded, as the models and error
# messages see them: past this a document is an alias bomb, not a configuration. A 4 MB file of plain
# values reaches it too, after ~6 MB of parsed nodes and about a second, long before it would fill memory.
MAX_DOCUMENT_VALUES = 10_000
# Profiles nest four levels; Python's own stack ends near 200.
MAX_DOCUMENT_DEPTH = 50
# A pipe's writer (`<(generate-profile)`) has this long to write the document and close the pipe.
PIPE_SECONDS = 30.0

_TAG = "tag:yaml.org,2002:"
Mark = Any  # PyYAML's marks: yaml.error.Mark from the pure-Python parser, yaml._yaml.Mark from libyaml


# ---- the file: regular, bounded --------------------------------------------------------------------------


def _refuse(path: Path, problem: str, summary: str | None = None) -> NoReturn:
    raise DocumentError(f"{path}: {problem}", path=path, summary=summary or problem)


def _open_error(path: Path, exc: OSError, kind: str) -> NoReturn:
    if isinstance(exc, FileNotFoundError):
        _refuse(path, "no such file; check the path")
    if isinstance(exc, PermissionError):
        _refuse(path, "cannot be read (permission denied); make it readable, e.g. chmod u+r")
    if exc.errno == errno.ENXIO:  # opening a socket (or a device with no driver) fails with "no such device"
        _refuse(path, f"is a socket or a device, not a file; give the path of {kind}")
    _refuse(path, f"cannot be read ({exc.strerror or exc}); check the path")


def _kind_problem(mode: int, kind: str) -> str | None:
    """Why a file of this mode is not a document (a folder, a device...), or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return f"is a folder, not a file; give the path of {kind}"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return f"is a device, not a file; give the path of {kind}"
    if stat.S_ISSOCK(mode):
        return f"is a socket, not a file; give the path of {kind}"
    if stat.S_ISFIFO(mode):
        return f"is a pipe, which can be read only once; save it to a file and give the path of {kind}"
    return f"is not a regular file; give the path of {kind}"


def _open(path: Path, kind: str) -> tuple[int, int]:
    """A descriptor of `path` and its file mode. O_NONBLOCK: opening a FIFO nobody writes to returns at once
    (a plain open would wait for a writer forever); the mode is read from the descriptor, not the name, so
    what is checked is what is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        _open_error(path, exc, kind)
    except ValueError as exc:  # a NUL byte in the path
        problem = f"cannot be used as a path ({exc}); check it"
        raise DocumentError(f"{str(path)!r}: {problem}", path=path, summary=problem) from None
    try:
        return fd, os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        _open_error(path, exc, kind)


def _too_large(path: Path, kind: str, limit: int) -> NoReturn:
    _refuse(path, f"is larger than {limit / 2**20:g} MiB, the most kvtune reads as {kind}; check the path")


def _read_regular(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = os.read(fd, min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _read_pipe(path: Path, fd: int, kind: str, limit: int, seconds: float) -> bytes:
    """What a pipe's writer sends until it closes the pipe, waiting at most `seconds` in all."""
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        try:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
        except BlockingIOError:  # a writer is there but has not written yet
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                _refuse(
                    path,
                    f"is a pipe whose writer did not finish within {seconds:g} s; give the path of {kind}",
                )
            continue
        if not chunk:  # the writer closed it, or there never was one (a FIFO nobody writes to)
            break
        chunks.append(chunk)
        size += len(chunk)
    if not chunks:
        _refuse(path, f"is a pipe nobody wrote to; give the path of {kind}")
    return b"".join(chunks)


def read_bytes(
    path: Path,
    kind: str = "a YAML file",
    *,
    limit: int = MAX_DOCUMENT_BYTES,
    pipe_seconds: float = PIPE_SECONDS,
) -> bytes:
    """The bytes of a regular file (or of a pipe, read once) of at most `limit` bytes; DocumentError naming
    the path otherwise. `kind` ("a YAML file") names what was expected in the fix."""
    fd, mode = _open(path, kind)
    try:
        if stat.S_ISFIFO(mode):
            raw = _read_pipe(path, fd, kind, limit, pipe_seconds)
        else:
            problem = _kind_problem(mode, kind)
            if problem:
                _refuse(path, problem)
            if os.fstat(fd).st_size > limit:  # refused before a byte is read (a large limit is a large read)
                _too_large(path, kind, limit)
            raw = _read_regular(fd, limit)
    except OSError as exc:  # EIO, or /proc/self/mem at offset 0
        _open_error(path, exc, kind)
    finally:
        os.close(fd)
    if len(raw) > limit:
        _too_large(path, kind, limit)
    return raw


def read_text(path: Path, kind: str = "a YAML file", *, limit: int = MAX_DOCUMENT_BYTES) -> str:
    """`read_bytes` as UTF-8 text."""
    raw = read_bytes(path, kind, limit=limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _refuse(
            path,
            f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it as UTF-8",
            f"is not UTF-8 text (at offset {exc.start})",
        )


@contextmanager
def open_regular(path: Path, kind: str) -> Iterator[IO[bytes]]:
    """A regular file opened for reading in binary, for documents read line by line (a replay trace, which
    may be larger than MAX_DOCUMENT_BYTES and is read again by each load generator, so never a pipe)."""
    fd, mode = _open(path, kind)
    problem = _kind_problem(mode, kind)
    if problem:
        os.close(fd)
        _refuse(path, problem)
    with os.fdopen(fd, "rb") as file:
        yield file


# ---- YAML 1.2, strictly ------------------------------------------------------------------------------------

# The YAML 1.2 core schema's plain scalars (https://yaml.org/spec/1.2.2/#1032-tag-resolution). Anything else
# plain is text: on/off/yes/no/y/n, 010 (decimal ten), 0b101, 1_000, 1:30:00 and dates.
_CORE_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_CORE_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
_CORE_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_CORE_FLOAT = re.compile(
    r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
)
_CORE = ((f"{_TAG}null", _CORE_NULL), (f"{_TAG}bool", _CORE_BOOL), (f"{_TAG}int", _CORE_INT))


class _Refused(yaml.MarkedYAMLError):
    """A document PyYAML would read that kvtune refuses: `problem` may quote it, `summary` does not."""

    def __init__(self, problem: str, summary: str, mark: Mark | None) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.summary = summary


def _at(mark: Mark | None) -> str:
    return f"line {mark.line + 1}" if mark is not None else "the document"


class _CoreResolver(BaseResolver):
    """Plain scalars resolved by YAML 1.2's core schema only (the patterns are added below)."""

    yaml_implicit_resolvers: dict[Any, list[tuple[str, re.Pattern[str]]]] = {}  # noqa: RUF012 - PyYAML's


class _StrictComposer(Composer):
    """Counts values as they would be with every alias expanded, and refuses loops, bombs and deep nesting
    while composing, before anything is built from them."""

    def __init__(self) -> None:
        super().__init__()
        self._values = 0  # values so far, each alias counted as the values it repeats
        self._sizes: dict[Node, int] = {}  # values of each anchored node, once it is complete
        self._aliases = 0
        self._depth = 0

    if TYPE_CHECKING:  # the parser it is mixed with gives the events

        def peek_event(self) -> yaml.Event: ...

    def _next_event(self) -> yaml.Event:
        return self.peek_event()

    def compose_document(self) -> Node | None:
        event = self._next_event()
        version = getattr(event, "version", None)
        if version is not None and tuple(version) != (1, 2):
            raise _Refused(
                f"declares YAML {version[0]}.{version[1]}, but kvtune reads YAML 1.2 (where on and yes are "
                "text and 010 is ten); remove the %YAML line",
                f"declares YAML {version[0]}.{version[1]}",
                event.start_mark,
            )
        return super().compose_document()

    def _count(self, values: int, mark: Mark) -> None:
        self._values += values
        if self._values > MAX_DOCUMENT_VALUES:
            expanded = " once its aliases are expanded" if self._aliases else ""
            fix = "write repeated values out instead of nesting aliases" if expanded else "check the path"
            problem = (
                f"holds more than {MAX_DOCUMENT_VALUES:,} values{expanded} (at {_at(mark)}); a profile or "
                f"spec holds a few hundred: {fix}"
            )
            raise _Refused(problem, f"holds more than {MAX_DOCUMENT_VALUES:,} values{expanded}", mark)

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        event = self._next_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)  # PyYAML refuses an undefined alias
            size = self._sizes.get(node) if node is not None else None
            if size is None:  # the anchor is still open: the alias is inside what it names
                raise _Refused(
                    f"alias *{cut(str(event.anchor), 60)} at {_at(event.start_mark)} is inside its own "
                    "anchor (a loop that never ends); write the value out",
                    f"an alias loop at {_at(event.start_mark)}",
                    event.start_mark,
                )
            self._aliases += 1
            self._count(size, event.start_mark)
            return node
        self._depth += 1
        if self._depth > MAX_DOCUMENT_DEPTH:
            raise _Refused(
                "is nested too deeply to read; flatten the document (more than "
                f"{MAX_DOCUMENT_DEPTH} levels at {_at(event.start_mark)})",
                f"is nested more than {MAX_DOCUMENT_DEPTH} levels deep",
                event.start_mark,
            )
        before = self._values
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        if getattr(event, "anchor", None) is not None and node is not None:
            self._sizes[node] = self._values - before
        self._depth -= 1
        return node


class _StrictConstructor(SafeConstructor):
    """Core-schema values only; a key written twice, a YAML 1.1 merge key or an unknown tag is refused."""

    yaml_constructors: ClassVar[dict[str | None, Any]] = {}

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        mapping: dict[Hashable, Any] = {}
        first: dict[Hashable, Node] = {}
        for key_node, value_node in node.value:
            if (
                key_node.tag == f"{_TAG}str"
                and key_node.value == "<<"
                and not getattr(
                    key_node, "style", None
                )  # plain: None from PyYAML's parser, '' from libyaml's
            ):
                raise _Refused(
                    f"{_at(key_node.start_mark)}: '<<' merge keys are YAML 1.1, which kvtune does not read; "
                    "write the fields out",
                    f"a YAML 1.1 merge key at {_at(key_node.start_mark)}",
                    key_node.start_mark,
                )
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                raise _Refused(
                    f"{_at(key_node.start_mark)}: a key is a list or a mapping; write keys as plain names",
                    f"a list or mapping as a key at {_at(key_node.start_mark)}",
                    key_node.start_mark,
                )
            if key in first:
                raise _duplicate(first[key], key_node)
            first[key] = key_node
            mapping[key] = self.construct_object(value_node, deep=deep)
        return mapping

    def construct_yaml_bool(self, node: ScalarNode) -> bool:
        value = self.construct_scalar(node)
        if not _CORE_BOOL.match(value):  # an explicit `!!bool yes`
            _not_core(node, value, "true or false")
        return value.lower() == "true"

    def construct_yaml_int(self, node: ScalarNode) -> int:
        value = self.construct_scalar(node)
        if not _CORE_INT.match(value):
            _not_core(node, value, "an integer: decimal, 0o octal or 0x hex")
        try:
            if value.startswith(("0o", "0x")):
                return int(value[2:], 8 if value[1] == "o" else 16)
            return int(value, 10)
        except ValueError:  # beyond Python's 4,300 digits
            raise _Refused(
                f"{_at(node.start_mark)}: an integer of {len(value):,} digits is too long to read; quote it "
                "if it is text",
                f"an integer too long to read at {_at(node.start_mark)}",
                node.start_mark,
            ) from None

    def construct_yaml_float(self, node: ScalarNode) -> float:
        value = self.construct_scalar(node)
        if not _CORE_FLOAT.match(value):
            _not_core(node, value, "a number")
        if value.lstrip("+-").lower() == ".inf":
            return -math.inf if value.startswith("-") else math.inf
        return math.nan if value.lower() == ".nan" else float(value)

    def construct_undefined(self, node: Node) -> NoReturn:
        raise _Refused(
            f"{_at(node.start_mark)}: the tag {_tag_name(node)} is not one kvtune reads; remove it (a "
            "profile or spec holds text, numbers, true/false, null, lists and mappings)",
            f"an unknown tag at {_at(node.start_mark)}",
            node.start_mark,
        )


def _tag_name(node: Node) -> str:
    tag = str(node.tag)
    return cut("!!" + tag.removeprefix(_TAG) if tag.startswith(_TAG) else tag, 60)


def _not_core(node: Node, value: str, expected: str) -> NoReturn:
    raise _Refused(
        f"{_at(node.start_mark)}: {brief(value)} tagged {_tag_name(node)} is not {expected} in YAML 1.2; fix "
        "the value or remove the tag",
        f"a tagged value that is not {expected} at {_at(node.start_mark)}",
        node.start_mark,
    )


def _duplicate(first: Node, second: Node) -> _Refused:
    shown = brief(getattr(second, "value", "")) if isinstance(second, ScalarNode) else "a key"
    lines = (first.start_mark.line + 1, second.start_mark.line + 1)
    where = f"twice on line {lines[0]}" if lines[0] == lines[1] else f"twice: lines {lines[0]} and {lines[1]}"
    same = isinstance(first, ScalarNode) and isinstance(second, ScalarNode) and first.value == second.value
    if not same:  # 1 and 1.0, or true and True: one key to YAML's reader
        where += f" (as {brief(getattr(first, 'value', ''))} and {shown})"
    return _Refused(
        f"key {shown} appears {where}; keep one", f"a key appears {where.split(' (')[0]}", second.start_mark
    )


for _tag, _pattern in _CORE:
    _CoreResolver.add_implicit_resolver(_tag, _pattern, None)
# After int: 10 is both, and the first match wins.
_CoreResolver.add_implicit_resolver(f"{_TAG}float", _CORE_FLOAT, None)

_CONSTRUCTORS: dict[str, Callable[..., Any]] = {
    "null": SafeConstructor.construct_yaml_null,
    "bool": _StrictConstructor.construct_yaml_bool,
    "int": _StrictConstructor.construct_yaml_int,
    "float": _StrictConstructor.construct_yaml_float,
    "str": SafeConstructor.construct_yaml_str,
    "seq": SafeConstructor.construct_yaml_seq,
    "map": SafeConstructor.construct_yaml_map,
}
_StrictConstructor.yaml_constructors.update({f"{_TAG}{name}": call for name, call in _CONSTRUCTORS.items()})
_StrictConstructor.yaml_constructors[None] = _StrictConstructor.construct_undefined


class _PureParser(Reader, Scanner, Parser):
    """PyYAML's own parser, in Python: the same events as libyaml's, about a hundred times slower."""

    def __init__(self, stream: str) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)


# libyaml parses a 4 MiB document in a twentieth of a second, PyYAML's Python parser in 10 s or more; only
# the parsing is libyaml's: composing (where aliases are counted), resolving and constructing stay above.
try:
    from yaml._yaml import CParser

    PARSERS: tuple[type, ...] = (CParser, _PureParser)
except ImportError:  # PyYAML built without libyaml
    PARSERS = (_PureParser,)


def _loader(parser: type) -> type:
    """The strict loader on `parser`'s events: our composer first, so its methods come before the parser's."""

    def __init__(self: Any, stream: str) -> None:
        cast(Any, parser).__init__(self, stream)
        _StrictComposer.__init__(self)
        _StrictConstructor.__init__(self)
        _CoreResolver.__init__(self)

    return type(
        "StrictLoader", (_StrictComposer, parser, _StrictConstructor, _CoreResolver), {"__init__": __init__}
    )


_LOADERS = {parser: _loader(parser) for parser in PARSERS}


def _yaml_error(path: Path, exc: yaml.YAMLError) -> DocumentError:
    """PyYAML's multi-line report as one line: where, and what it found."""
    if isinstance(exc, _Refused):
        return DocumentError(f"{path}: {cut(str(exc.problem))}", path=path, summary=exc.summary)
    if isinstance(exc, ReaderError):
        at = f" at offset {exc.position}"
        reason = f"character #x{exc.character:04x} is not allowed in YAML"
    else:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = " ".join(str(getattr(exc, "problem", None) or exc).split())
    if reason == "exceeded maximum nesting depth":  # libyaml's own bound, met as it scans ahead
        return DocumentError(
            f"{path}: is nested too deeply to read; flatten the document (too deep{at})",
            path=path,
            summary="is nested too deeply",
        )
    return DocumentError(
        f"{path}: not valid YAML{at}: {cut(reason, 200)}; fix the syntax there",
        path=path,
        summary=f"not valid YAML{at}",
    )


def parse_yaml(text: str, path: Path, parser: type = PARSERS[0]) -> Any:
    """`text` (the content of `path`) as YAML 1.2; DocumentError naming `path` when kvtune cannot use it.
    `parser` is libyaml's where PyYAML was built with it; both give the same values."""
    loader = _LOADERS[parser](text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise _yaml_error(path, exc) from None
    except RecursionError:
        _refuse(path, "is nested too deeply to read; flatten the document")
    finally:
        loader.dispose()


def read_yaml(path: Path) -> Any:
    """The document in `path`; DocumentError (one line naming the file and the fix) when it cannot be read."""
    data = parse_yaml(read_text(path), path)
    if data is None:
        _refuse(path, "is empty; write its fields as a YAML mapping (name: value per line)", "is empty")
    return data


def load_yaml_model(model: type[M], path: Path) -> M:
    """Read `path` as YAML and validate it; relative paths inside resolve against the file's folder."""
    return validate(model, read_yaml(path), str(path), context={"base_dir": path.parent})


class _Dumper(yaml.SafeDumper):
    """Quotes every string YAML 1.1 or 1.2 would read as something else ('1e3', '0o17', 'on', '010'), so
    what kvtune writes reads back the same here and in tools that read YAML 1.1 (vLLM's --config)."""


for _tag, _pattern in (*_CORE, (f"{_TAG}float", _CORE_FLOAT)):
    _Dumper.add_implicit_resolver(_tag, _pattern, None)


def dump_yaml(data: Any) -> str:
    """`data` as block YAML in the order given."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


# ---- JSON -------------------------------------------------------------------------------------------------


class _JsonRefused(ValueError):
    """JSON the standard parser reads that kvtune refuses: `problem` may quote it, `summary` does not."""

    def __init__(self, problem: str, summary: str) -> None:
        super().__init__(problem)
        self.summary = summary


def _no_constant(name: str) -> float:
    raise _JsonRefused(f"holds {name}, which is not a number; write a finite number", f"holds {name}")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _JsonRefused(
            f"holds a number too large for a float ({cut(text, 40)}); write a smaller one",
            "holds a number too large",
        )
    return value


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise _JsonRefused(f"an object holds the key {brief(key)} twice; keep one", "a key appears twice")
        data[key] = value
    return data


def parse_json(text: str, path: Path | str) -> Any:
    """`text` as JSON without NaN, Infinity or a key written twice; DocumentError naming `path`."""
    try:
        return json.loads(
            text, parse_constant=_no_constant, parse_float=_finite, object_pairs_hook=_no_duplicates
        )
    except json.JSONDecodeError as exc:
        at = f"at line {exc.lineno}, column {exc.colno}"
        raise DocumentError(
            f"{path}: not valid JSON {at} ({exc.msg}); fix the file",
            path=path,
            summary=f"not valid JSON {at}",
        ) from None
    except _JsonRefused as exc:
        raise DocumentError(f"{path}: {exc}", path=path, summary=exc.summary) from None
    except ValueError:  # an integer beyond Python's 4,300 digits
        raise DocumentError(
            f"{path}: holds an integer too long to read; fix the file",
            path=path,
            summary="an integer too long",
        ) from None
    except RecursionError:
        raise DocumentError(
            f"{path}: is nested too deeply to read", path=path, summary="is nested too deeply"
        ) from None


def read_json(path: Path, kind: str = "a JSON file") -> Any:
    """The JSON document in `path`, read as `read_text` reads (a regular file, bounded) and `parse_json`
    parses."""
    return parse_json(read_text(path, kind), path)
