"""Any profile or sweep-spec document loads as a model or fails with a ConfigError naming its file.

hypothesis writes generated documents to files and loads them with `load_profile` / `load_spec`: the shipped
deploy/ documents mutated (fields dropped, retyped, set to odd values or to extremes their own checks accept,
unknown keys, nested junk, new search-space entries), documents shaped by the models, random mappings, any
YAML value, and raw bytes (invalid YAML, non-UTF-8, damaged shipped files). A document that loads is then
rendered or dry-run in-process (`kvtune render`, `kvtune sweep --dry-run`): no traceback there either.

Examples per run, derandomized so CI runs the same ones every time: profiles 300 mutated, 200 with extremes,
150 generated; specs 300 mutated, 150 with extremes, 150 new space entries, 100 on a mutated base profile,
150 generated; 300 raw files. Through the real CLI, a subprocess per document: 12 bad profiles
(`kvtune render`) and 12 bad specs (`kvtune sweep --dry-run`) exit 2 without a traceback. Unreadable files
(a folder, a device, no permission, over 4 MiB, not UTF-8, empty, a list or a value) are pinned one by one,
as is the message. The strict reader's own refusals (YAML 1.1, aliases, special files): test_documents.py.
"""

from __future__ import annotations

import copy
import math
import operator
import os
import random
import shutil
import signal
import subprocess
import sys
import types
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ByteSize, ValidationError
from pydantic.fields import FieldInfo

from kvtune.cli import main as cli_main
from kvtune.config_errors import MAX_LINES, ConfigError, format_validation_errors
from kvtune.loadgen.workload_args import WORKLOAD_NAMES, workload_args
from kvtune.profile import EngineProfile, load_profile
from kvtune.sweep.spec import KNOBS, Range, SweepSpec, load_spec

REPO = Path(__file__).resolve().parent.parent
PROFILE_FILES = sorted((REPO / "deploy" / "profiles").glob("*.yaml"))
SPEC_FILES = sorted((REPO / "deploy" / "sweeps").glob("*.yaml"))

MUTATED_PROFILES = 300
EXTREME_PROFILES = 200
GENERATED_PROFILES = 150
MUTATED_SPECS = 300
EXTREME_SPECS = 150
SPACE_ENTRIES = 150
SPECS_ON_MUTATED_PROFILES = 100
GENERATED_SPECS = 150
RAW_EXAMPLES = 300
CLI_EXAMPLES = 12
# A shipped document loads in about 20 ms: one that takes over a thousand times that has made loading
# unbounded (a range of a billion values), which is as much a failure as a traceback. The bound is wall
# time and `make test` runs these beside engine tests on 2 cores: a first load (cold imports) on a busy host
# took over 2 s, so the bound is generous.
LOAD_SECONDS = 30.0

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
# The CLI examples are kept only when the loader refuses them, so most draws may be filtered out.
CLI = settings(FUZZ, max_examples=CLI_EXAMPLES, suppress_health_check=list(HealthCheck))
Loader = Callable[[Path], BaseModel]


# ---- the property -----------------------------------------------------------------------------------------


class LoadTookTooLong(AssertionError):
    pass


@contextmanager
def bounded_time(seconds: float) -> Iterator[None]:
    def expire(_signum: int, _frame: FrameType | None) -> None:
        raise LoadTookTooLong(f"loading took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_or_config_error(load: Loader, path: Path, model: type[BaseModel], command: list[str]) -> None:
    """The model, or the ConfigError naming `path`; any other exception fails the property. A document that
    loads is then given to its command in-process (`kvtune render`, `kvtune sweep --dry-run`): exit 0, or 2
    for a check only the command makes, never a traceback."""
    # Shown with a failing example: schemathesis' pytest plugin blanks hypothesis' own argument reprs.
    raw = path.read_bytes()[:4000]
    try:
        note(f"{path.name}:\n{raw.decode('utf-8')}")
    except UnicodeDecodeError:
        note(f"{path.name}: {raw!r}")
    try:
        with bounded_time(LOAD_SECONDS):
            result = load(path)
    except ConfigError as exc:
        assert str(path) in str(exc), f"the error does not name the file: {exc}"
        assert "Traceback" not in str(exc)
        return
    assert isinstance(result, model)
    with bounded_time(LOAD_SECONDS):
        assert cli_main([*command, str(path)]) in (0, 2)


def check_profile(path: Path) -> None:
    load_or_config_error(load_profile, path, EngineProfile, ["render"])


def check_spec(path: Path) -> None:
    load_or_config_error(load_spec, path, SweepSpec, ["sweep", "--dry-run"])


# ---- documents --------------------------------------------------------------------------------------------


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and not typing.get_args(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def all_fields(*roots: type[BaseModel]) -> dict[str, FieldInfo]:
    """Every field of the models and of the models nested in them, by name (the first one of a name wins)."""
    found: dict[str, FieldInfo] = {}
    todo, seen = list(roots), set()
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            found.setdefault(name, field)
            todo += _models_in(field.annotation)
    return found


def _shipped(paths: list[Path]) -> list[dict[str, Any]]:
    return [yaml.safe_load(path.read_text(encoding="utf-8")) for path in paths]


def _shipped_values(docs: list[Any]) -> dict[str, list[Any]]:
    """Every value a shipped document gives each field name: realistic values to mix with odd ones."""
    found: dict[str, list[Any]] = {}
    todo = list(docs)
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                found.setdefault(str(key), []).append(value)
                todo.append(value)
        elif isinstance(node, list):
            todo += node
    return found


PROFILE_DOCS = _shipped(PROFILE_FILES)
SPEC_DOCS = _shipped(SPEC_FILES)
SHIPPED_VALUES = _shipped_values(PROFILE_DOCS + SPEC_DOCS)
FIELDS = all_fields(SweepSpec, EngineProfile)
KEYS = st.sampled_from(sorted(FIELDS) + list(KNOBS)) | st.text(max_size=12)

ODD_VALUES: st.SearchStrategy[Any] = st.sampled_from(
    [
        None, True, False, 0, -1, 1, 7, 33, 2**31, 2**64, 10**30, 0.5, -0.0, 1e-9, 1e308,
        math.inf, -math.inf, math.nan,
        "", " ", "abc", "1GiB", "-1GiB", "96MiB", "0x10", "1e3", "auto", "fp8", "cpu", "cuda", "none",
        "../../x", "/", ".", "/dev/null", "é", "\u202e", "a\nb", "$(touch /tmp/x)", "A=B", "--port=1",
        "a" * 300, "x/" * 200,
        [], [None], [1, "a"], [[]], {}, {"a": 1}, {"min": 1, "max": 0, "step": 1},
        {"min": 32, "max": 128, "step": 32}, {"text": None},
    ]
).map(copy.deepcopy)  # fmt: skip  # a fresh copy: mutations must not change the pool
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
YAML_VALUES = st.recursive(
    SCALARS | ODD_VALUES,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(KEYS | st.integers(-3, 3), children, max_size=4)
    ),
    max_leaves=12,
)
PATHS = st.sampled_from(
    [
        "../profiles/cpu-smollm2.yaml", "cpu-smollm2.yaml", "../profiles", "nope.txt", "/", ".", "",
        "/dev/null", "/proc/self/mem", "a" * 300, "x/" * 40 + "y", "~/p.yaml", "../sweeps/cpu-quick.yaml",
    ]
)  # fmt: skip
BYTE_SIZES = st.sampled_from(["1GiB", "96MiB", "0", "-1KiB", "1e400B", "1 GB", "lots", "1.5GiB", "1TiB"])
MAX_DEPTH = 3


def edges(field: FieldInfo) -> list[Any]:
    """A number field's bounds and their neighbours, and extremes inside them: where arithmetic breaks."""
    out: list[Any] = [2**63, 1e308, 5e-324]
    for constraint in field.metadata:
        for bound in (getattr(constraint, attr, None) for attr in ("gt", "ge", "lt", "le")):
            if isinstance(bound, int | float):
                out += [bound, bound - 1, bound + 1, bound + 1e-9]
    return out


def typed(annotation: Any, name: str = "", depth: int = 0) -> st.SearchStrategy[Any]:
    """A value for a field: mostly of its type or a shipped document's value, sometimes odd."""
    options = [_of_type(annotation, depth)] * 2 + [ODD_VALUES]
    if name in SHIPPED_VALUES:
        options.append(st.sampled_from(SHIPPED_VALUES[name]).map(copy.deepcopy))
    return st.one_of(options)


def for_field(field: FieldInfo, name: str, depth: int = 0) -> st.SearchStrategy[Any]:
    """A value for a field: as `typed`, and for numbers often one at (or just past) their bounds."""
    value = typed(field.annotation, name, depth)
    numeric = {int, float, ByteSize} & {t for t in [field.annotation, *typing.get_args(field.annotation)]}
    return value | st.sampled_from(edges(field)) if numeric else value


def _of_type(annotation: Any, depth: int) -> st.SearchStrategy[Any]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or depth > MAX_DEPTH:
        return YAML_VALUES
    if origin is typing.Annotated:
        return _of_type(args[0], depth)
    if origin is typing.Union or origin is types.UnionType:
        return st.one_of([_of_type(arg, depth) for arg in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin in (list, tuple, set):
        return st.lists(typed(args[0] if args else Any, depth=depth + 1), max_size=4)
    if origin is dict:
        return st.dictionaries(KEYS, typed(args[1], depth=depth + 1), max_size=4)
    if _models_in(annotation):
        return model_documents(annotation, depth + 1)
    scalars: dict[Any, st.SearchStrategy[Any]] = {
        type(None): st.none(),
        ByteSize: st.integers(-1, 2**70) | BYTE_SIZES,
        bool: st.booleans(),
        int: st.integers(-(2**16), 2**40) | st.sampled_from([0, 1, 32, 100, 128, 8192, 2**63]),
        float: st.floats(allow_nan=True, allow_infinity=True),
        Path: PATHS | st.text(max_size=20),
    }
    return scalars.get(annotation, st.text(max_size=20))


RANGE_NUMBERS = st.sampled_from([0, 1, 2, 32, 128, 0.5, 1e-9, 1e9, 2**40, -1, math.inf, -math.inf, math.nan])
# Mostly well-formed ranges (min below max, a positive step), so the checks on their values are reached.
RANGE_FIELD = RANGE_NUMBERS | st.floats()
RANGES = st.fixed_dictionaries({"min": RANGE_FIELD, "max": RANGE_FIELD, "step": RANGE_FIELD}).map(
    lambda r: r | {"min": r["max"], "max": r["min"]} if r["max"] < r["min"] else r
)


def knob_values(knob: str, depth: int = 0) -> st.SearchStrategy[Any]:
    """A search-space entry: a list of the knob's own values, or a range."""
    values = for_field(EngineProfile.model_fields[knob], knob, depth) if knob in KNOBS else YAML_VALUES
    return st.lists(values, max_size=3) | RANGES | model_documents(Range, depth)


def spaces(depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    knobs = st.lists(st.sampled_from(KNOBS) | st.text(max_size=8), max_size=4, unique=True)
    return knobs.flatmap(lambda names: st.fixed_dictionaries({k: knob_values(k, depth) for k in names}))


@st.composite
def model_documents(draw: st.DrawFn, model: type[BaseModel], depth: int = 0) -> dict[str, Any]:
    """A mapping for `model`: required fields mostly there, optional ones sometimes, at times a stray key."""
    doc: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        if draw(st.integers(0, 9)) < (9 if field.is_required() else 4):
            is_space = model is SweepSpec and name == "space"
            doc[name] = draw(spaces(depth) if is_space else for_field(field, name, depth))
    if draw(st.integers(0, 9)) == 0:
        doc[draw(KEYS)] = draw(YAML_VALUES)
    return doc


def _slots(node: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Paths to every value inside a document (mapping keys and list indices)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield (*at, key)
        yield from _slots(child, (*at, key))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def value_for(path: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """A value of the field at `path`'s own type (a knob's values inside `space`), else any value."""
    if len(path) >= 2 and path[-2] == "space":
        return knob_values(str(path[-1]))
    if path and path[-1] in FIELDS:
        return for_field(FIELDS[path[-1]], str(path[-1]))
    return YAML_VALUES


@st.composite
def mutated(draw: st.DrawFn, shipped: list[dict[str, Any]]) -> Any:
    """A shipped document with a few fields dropped, retyped, set to odd values or added (mostly one, so
    the checks that run only on an otherwise valid document are reached too)."""
    # What, where and how to mutate is chosen uniformly (a seeded Random): hypothesis's own choices favour
    # the first option, which would mostly drop the first field of the first document.
    pick = draw(st.randoms(use_true_random=True))
    doc = copy.deepcopy(pick.choice(shipped))
    for _ in range(pick.choice([1, 1, 1, 2, 3])):
        slots = list(_slots(doc))
        action = pick.choice(["drop", "odd", "typed", "typed", "junk", "add", "knob"])
        if action == "knob" and isinstance(doc.get("space"), dict):
            knob = draw(st.sampled_from(KNOBS))
            doc["space"][knob] = draw(knob_values(knob))
            continue
        if action in ("add", "knob") or not slots:
            at = pick.choice([()] + [p for p in slots if isinstance(_get(doc, p), dict)])
            key = draw(st.sampled_from(KNOBS) if at and at[-1] == "space" else KEYS)
            _get(doc, at)[key] = draw(value_for((*at, key)))
            continue
        path = pick.choice(slots)
        parent = _get(doc, path[:-1])
        if action == "drop":
            del parent[path[-1]]
        else:
            strategy = {"odd": ODD_VALUES, "typed": value_for(path)}.get(action, YAML_VALUES)
            parent[path[-1]] = draw(strategy)
    return doc


def documents(model: type[BaseModel]) -> st.SearchStrategy[Any]:
    """Documents shaped by the model (its fields, mostly of their types), random mappings, any YAML value."""
    return model_documents(model) | st.dictionaries(KEYS, YAML_VALUES, max_size=8) | YAML_VALUES


FieldPath = tuple[str, ...]


def _leaf_fields(model: type[BaseModel], at: FieldPath = ()) -> Iterator[tuple[FieldPath, FieldInfo]]:
    """(path, field) of every scalar field, through nested models (a spec's `load.max_rate`)."""
    for name, field in model.model_fields.items():
        nested = _models_in(field.annotation)
        if nested and typing.get_origin(field.annotation) not in (list, dict):
            yield from _leaf_fields(nested[0], (*at, name))
        elif not nested:
            yield (*at, name), field


BOUND_CHECKS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le}


def _within(value: float, field: FieldInfo) -> bool:
    """Whether a number meets the field's own bounds (so the checks across fields run on it)."""
    for constraint in field.metadata:
        for attr, check in BOUND_CHECKS.items():
            bound = getattr(constraint, attr, None)
            if bound is not None and not check(value, bound):
                return False
    return True


EXTREME_NUMBERS = [5e-324, 1e-9, 0.5, 1, 2, 2**31, 2**53 + 1, 2**63, 10**30, 1e15, 1e308]
EXTREME_TEXT = ["a" * 300, "x/" * 200, "", " ", "\u202e", "~", "..", "smollm2-135m"]


def extreme_values(field: FieldInfo) -> list[Any]:
    kinds = {field.annotation, *typing.get_args(field.annotation)}
    if kinds & {int, ByteSize}:
        return [v for v in EXTREME_NUMBERS if isinstance(v, int) and _within(v, field)]
    if float in kinds:
        return [v for v in EXTREME_NUMBERS if _within(v, field)]
    if kinds & {str, Path}:
        return EXTREME_TEXT
    return []


def extreme_workload(pick: random.Random) -> dict[str, Any]:
    """A workload with some of its own flags (from their one definition) at extremes."""
    name = pick.choice(WORKLOAD_NAMES)
    by_kind: dict[type, list[Any]] = {
        int: [v for v in EXTREME_NUMBERS if isinstance(v, int)],
        float: [v for v in EXTREME_NUMBERS if v <= 1] + [1e308],
        str: [*EXTREME_TEXT, "/proc/self/mem", "/dev/null", "../profiles", "cpu-quick.yaml"],
        bool: [True, False, "yes", "maybe"],
    }
    flags = workload_args(name)
    chosen = pick.sample(flags, pick.randint(1, len(flags)))
    return {"name": name, "args": {arg.flag: pick.choice(by_kind[arg.kind]) for arg in chosen}}


@st.composite
def with_extremes(draw: st.DrawFn, shipped: list[dict[str, Any]], model: type[BaseModel]) -> Any:
    """A shipped document with one to three fields at extremes their own checks accept (the largest float,
    2**63, a 300-character name): the arithmetic and paths across fields must cope, or say why not."""
    pick = draw(st.randoms(use_true_random=True))  # uniform: hypothesis favours the first fields and values
    doc = copy.deepcopy(pick.choice(shipped))
    choices = [(path, values) for path, field in _leaf_fields(model) if (values := extreme_values(field))]
    for path, values in pick.sample(choices, pick.randint(1, 3)):
        holder = doc
        for key in path[:-1]:
            holder = holder.setdefault(key, {})
        holder[path[-1]] = pick.choice(values)
    if model is SweepSpec and pick.random() < 0.3:
        doc["workload"] = extreme_workload(pick)
    return doc


def write_yaml(path: Path, doc: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, allow_unicode=True), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ as shipped, so the specs' relative base_profile paths resolve; documents are written inside."""
    root = tmp_path_factory.mktemp("deploy")
    shutil.copytree(REPO / "deploy", root, dirs_exist_ok=True)
    return root


# ---- in-process: model or named error (one test per kind of document, each with its stated share) ------


@settings(FUZZ, max_examples=MUTATED_PROFILES)
@given(doc=mutated(PROFILE_DOCS))
def test_mutated_profiles_are_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    path = write_yaml(deploy_copy / "profiles" / "fuzzed.yaml", doc)
    check_profile(path)


@settings(FUZZ, max_examples=GENERATED_PROFILES)
@given(doc=documents(EngineProfile))
def test_generated_profiles_are_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    path = write_yaml(deploy_copy / "profiles" / "fuzzed.yaml", doc)
    check_profile(path)


@settings(FUZZ, max_examples=EXTREME_PROFILES)
@given(doc=with_extremes(PROFILE_DOCS, EngineProfile))
def test_profiles_with_extreme_values_are_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    path = write_yaml(deploy_copy / "profiles" / "fuzzed.yaml", doc)
    check_profile(path)


@settings(FUZZ, max_examples=EXTREME_SPECS)
@given(doc=with_extremes(SPEC_DOCS, SweepSpec))
def test_specs_with_extreme_values_are_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    path = write_yaml(deploy_copy / "sweeps" / "fuzzed.yaml", doc)
    check_spec(path)


@settings(FUZZ, max_examples=MUTATED_SPECS)
@given(doc=mutated(SPEC_DOCS))
def test_mutated_specs_are_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    path = write_yaml(deploy_copy / "sweeps" / "fuzzed.yaml", doc)
    check_spec(path)


@st.composite
def specs_with_a_new_space_entry(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = copy.deepcopy(draw(st.sampled_from(SPEC_DOCS)))
    knob = draw(st.sampled_from(KNOBS))
    doc["space"][knob] = draw(knob_values(knob))
    return doc


@settings(FUZZ, max_examples=SPACE_ENTRIES)
@given(doc=specs_with_a_new_space_entry())
def test_any_search_space_entry_is_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    """The space is checked against the base profile value by value: the deepest checks a spec has."""
    path = write_yaml(deploy_copy / "sweeps" / "fuzzed.yaml", doc)
    check_spec(path)


@settings(FUZZ, max_examples=SPECS_ON_MUTATED_PROFILES)
@given(doc=st.sampled_from(SPEC_DOCS), base=mutated(PROFILE_DOCS))
def test_specs_on_a_mutated_base_profile_are_a_model_or_a_named_error(
    deploy_copy: Path, doc: dict[str, Any], base: Any
) -> None:
    write_yaml(deploy_copy / "profiles" / "fuzzed-base.yaml", base)
    doc = doc | {"base_profile": "../profiles/fuzzed-base.yaml"}
    path = write_yaml(deploy_copy / "sweeps" / "fuzzed.yaml", doc)
    check_spec(path)


@settings(FUZZ, max_examples=GENERATED_SPECS)
@given(doc=documents(SweepSpec))
def test_generated_specs_are_a_model_or_a_named_error(deploy_copy: Path, doc: Any) -> None:
    path = write_yaml(deploy_copy / "sweeps" / "fuzzed.yaml", doc)
    check_spec(path)


# 10**6 values once its aliases are expanded, in 400 bytes.
BOMB = "l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 6)
)
YAML_FRAGMENTS = st.sampled_from(
    [
        "model: x\n", "name: n\n", "port: [\n", "space:\n  max_num_seqs: [1, 2]\n", ": :\n", "- a\n",
        "&a [*a]\n", "*nope\n", "!!python/object/apply:os.system ['true']\n", "\t- x\n", "%YAML 1.1\n---\n",
        "---\n...\n", "{", "'", '"\\x"', "? [a]\n: b\n", "a: 2001-13-01\n", "a: !!binary '%%'\n",
        "a: 0b102\n", "a: " + "9" * 4400 + "\n", "[" * 300, "a: b: c\n", "\ufeffmodel: x\n", "\x00",
        # YAML 1.1 scalars, repeated keys, merge keys, aliases and a bomb: what the strict reader refuses
        "port: on\n", "max_num_seqs: 010\n", "ready_timeout_s: 1:30:00\n", "port: 1\nport: 2\n",
        "<<: {a: 1}\n", "a: &x [1, *x]\n", "b: *x\n", BOMB,
    ]
)  # fmt: skip


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    """A shipped file truncated, or with bytes inserted: the half-saved or badly pasted file."""
    raw = draw(st.sampled_from(PROFILE_FILES + SPEC_FILES)).read_bytes()
    at = draw(st.integers(0, len(raw)))
    if draw(st.booleans()):
        return raw[:at]
    return raw[:at] + draw(st.binary(min_size=1, max_size=8) | YAML_FRAGMENTS.map(str.encode)) + raw[at:]


RAW_FILES = (
    st.binary(max_size=200)
    | st.lists(YAML_FRAGMENTS, max_size=6).map(lambda parts: "".join(parts).encode())
    | st.text(max_size=200).map(str.encode)
    | st.tuples(st.text(max_size=60), st.sampled_from(["latin-1", "utf-16", "utf-32"])).map(
        lambda pair: ("model: " + pair[0]).encode(pair[1], "replace")
    )
    | damaged()
)


@settings(FUZZ, max_examples=RAW_EXAMPLES)
@given(raw=RAW_FILES, as_spec=st.booleans())
def test_any_file_is_a_model_or_a_named_error(deploy_copy: Path, raw: bytes, as_spec: bool) -> None:
    folder = deploy_copy / ("sweeps" if as_spec else "profiles")
    path = folder / "raw.yaml"
    path.write_bytes(raw)
    if as_spec:
        check_spec(path)
    else:
        check_profile(path)


# ---- the real CLI on bad documents -------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("kvtune")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kvtune.cli"]
    return subprocess.run(
        [*command, *args], capture_output=True, text=True, timeout=60, check=False, cwd=REPO
    )


def bad_file(path: Path, content: Any, load: Loader) -> Path:
    """Write the document; keep only those the loader refuses (the CLI must then exit 2)."""
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        write_yaml(path, content)
    try:
        load(path)
    except ConfigError:
        return path
    assume(False)
    return path


def assert_refused(result: subprocess.CompletedProcess[str], path: Path) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert str(path) in " ".join(result.stderr.split()), result.stderr


@CLI
@given(content=mutated(PROFILE_DOCS) | damaged())
def test_render_refuses_bad_profiles_with_exit_2(deploy_copy: Path, content: Any) -> None:
    path = bad_file(deploy_copy / "profiles" / "cli.yaml", content, load_profile)
    assert_refused(run_cli("render", str(path)), path)


@CLI
@given(content=mutated(SPEC_DOCS) | damaged())
def test_sweep_dry_run_refuses_bad_specs_with_exit_2(deploy_copy: Path, content: Any) -> None:
    path = bad_file(deploy_copy / "sweeps" / "cli.yaml", content, load_spec)
    assert_refused(run_cli("sweep", "--dry-run", str(path)), path)


# ---- unreadable documents: one line naming the file and the fix --------------------------------------------

LOADERS = pytest.mark.parametrize("load", [load_profile, load_spec], ids=["profile", "spec"])


def only_error(load: Loader, path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


@LOADERS
def test_a_folder_is_not_a_file(load: Loader, tmp_path: Path) -> None:
    assert "is a folder, not a file; give the path of a YAML file" in only_error(load, tmp_path)


@LOADERS
def test_an_unreadable_file_names_the_fix(
    load: Loader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "locked.yaml"
    path.write_text("model: x\n")
    path.chmod(0)
    if os.geteuid() == 0:  # root reads any file: the refusal the OS gives everyone else, injected
        real_open = os.open

        def refuse(name: Any, *args: Any, **kwargs: Any) -> int:
            if Path(name) == path:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(name, *args, **kwargs)

        monkeypatch.setattr(os, "open", refuse)
    assert "cannot be read (permission denied); make it readable" in only_error(load, path)


@LOADERS
def test_a_missing_file(load: Loader, tmp_path: Path) -> None:
    assert "no such file; check the path" in only_error(load, tmp_path / "nope.yaml")


@LOADERS
def test_a_file_that_is_not_utf8(load: Loader, tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("model: café\n".encode("latin-1"))
    assert "is not UTF-8 text (byte 0xe9 at offset 10); save it as UTF-8" in only_error(load, path)


@LOADERS
def test_a_device_is_refused_not_read_forever(load: Loader) -> None:
    message = only_error(load, Path("/dev/zero"))
    assert "is a device, not a file; give the path of a YAML file" in message


@LOADERS
def test_a_large_file_is_refused_by_size(load: Loader, tmp_path: Path) -> None:
    path = tmp_path / "image.yaml"
    path.write_bytes(b"# " + b"x" * (4 * 2**20) + b"\n")
    message = only_error(load, path)
    assert "is larger than 4 MiB, the most kvtune reads as a YAML file; check the path" in message


def test_a_profile_from_a_pipe_loads() -> None:
    """`kvtune render <(generate-profile)`: the shell passes a pipe, which is read like a file."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, PROFILE_FILES[0].read_bytes())
        os.close(write_end)
        assert load_profile(Path(f"/dev/fd/{read_end}")).name == PROFILE_DOCS[0]["name"]
    finally:
        os.close(read_end)


@LOADERS
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "is empty; write its fields as a YAML mapping"),
        ("# only a comment\n", "is empty; write its fields as a YAML mapping"),
        ("- model: x\n", "fields (name: value per line), got a list"),
        ("smollm2-135m\n", "fields (name: value per line), got a single value ('smollm2-135m')"),
        ("42\n", "fields (name: value per line), got a single value (42)"),
        ("model: [\n", "not valid YAML at line 2, column 1: "),  # then libyaml's or PyYAML's words
        ("a: 1\na: 2\n", "key 'a' appears twice: lines 1 and 2; keep one"),
        ("a: " + "[" * 1000 + "]" * 1000 + "\n", "is nested too deeply to read; flatten the document"),
    ],
    ids=["empty", "comment", "list", "string", "int", "syntax", "duplicate", "deep"],
)
def test_documents_that_are_not_a_mapping(load: Loader, tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "doc.yaml"
    path.write_text(text, encoding="utf-8")
    assert expected in only_error(load, path)


def test_cli_names_an_unreadable_file_without_traceback(tmp_path: Path) -> None:
    for args in (["render", str(tmp_path)], ["sweep", "--dry-run", str(tmp_path)]):
        result = run_cli(*args)
        assert_refused(result, tmp_path)
        assert "is a folder, not a file" in " ".join(result.stderr.split())


# ---- format_validation_errors never raises and names the full path -----------------------------------------


def errors_for(model: type[BaseModel], data: Any) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return format_validation_errors(info.value, model, "doc.yaml")


class BrokenRepr:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")

    __hash__ = None  # type: ignore[assignment]  # unhashable, too


def test_errors_on_huge_and_odd_inputs_still_format() -> None:
    recursive: list[Any] = []
    recursive.append(recursive)
    odd = {
        "model": recursive,
        "port": 10**5000,
        "max_model_len": "x" * 10**6,
        "served_model_name": BrokenRepr(),
    }
    message = errors_for(EngineProfile, odd)
    lines = message.splitlines()
    assert lines[0] == "doc.yaml: invalid EngineProfile:"
    assert any(line.startswith("  model: [[[[...]]]] is not valid") for line in lines), message
    assert any(
        line.startswith("  port: <an integer of about 5,000 digits> is not valid") for line in lines
    ), message
    assert any(line.startswith("  served_model_name: <BrokenRepr") for line in lines), message
    assert any(line.startswith("  max_model_len: 'xxxxxxxx") for line in lines), message
    assert max(len(line) for line in lines) < 300


def test_errors_name_the_full_path_without_union_member_tags() -> None:
    spec = SPEC_DOCS[0] | {"base_profile": str(PROFILE_FILES[0])}
    message = errors_for(
        SweepSpec,
        spec
        | {
            "space": {"max_num_seqs": "many", "block_size": {"min": 32, "max": 64, "step": 32, "stepp": 1}},
            "workload": {"args": {"system-tokens": [1]}},
        },
    )
    assert "space.max_num_seqs: 'many' is not valid: Input should be a valid list, or " in message
    assert "space.block_size.stepp: unknown field; did you mean 'step'?" in message
    assert "workload.args.system-tokens: [1] is not valid: Input should be a valid string, or " in message
    assert "function-after" not in message and "list[any]" not in message


def test_a_value_shaped_like_one_union_member_reports_only_that_member() -> None:
    spec = SPEC_DOCS[0] | {"base_profile": str(PROFILE_FILES[0])}
    message = errors_for(SweepSpec, spec | {"space": {"max_num_seqs": {"min": 8, "max": 2, "step": 1}}})
    assert "space.max_num_seqs: max 2.0 is below min 8.0; swap them" in message
    assert "valid list" not in message


def test_many_problems_are_capped_with_a_count() -> None:
    message = errors_for(EngineProfile, {"model": "x", "env": {f"V{i}": [i] for i in range(40)}})
    lines = message.splitlines()
    assert len(lines) == 1 + MAX_LINES
    assert lines[-1] == f"  ... and {40 - MAX_LINES + 1} more problems"


def test_an_unknown_key_of_a_list_item_suggests_the_near_field() -> None:
    message = errors_for(EngineProfile, {"model": "x", "warmup": [{"text": "hi", "rol": "system"}]})
    assert "warmup[0].rol: unknown field; did you mean 'role'?" in message
    message = errors_for(EngineProfile, {"model": "x", "env": {"A": 1, 2: "b"}})
    assert "env.A: 1 is not valid: Input should be a valid string" in message
    assert "env[2] (the key): 2 is not valid" in message


def test_generated_documents_know_every_nested_field() -> None:
    assert {"kv_cache_dtype", "ttft_p99_s", "max_rate", "step", "role", "prompts_file"} <= set(FIELDS)
