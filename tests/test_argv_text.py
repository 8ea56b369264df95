"""No text that reaches an engine's command line holds `$(`, which Kubernetes expands in a container's args
from the container's environment (a secret listed in secret_env included): the profile, `kvtune render` and
the chart's schema refuse it naming the field.

The fields are not listed here: they are those whose FieldFacts say their text reaches argv, and a test
renders every field of the profile to check the facts say so exactly. Values are generated: `$(` inserted
anywhere in a value the profile otherwise accepts.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic.alias_generators import to_camel

from kvtune.cli import main as cli_main
from kvtune.helm.values import chart_values, values_schema
from kvtune.profile import EngineProfile, chart_fields, facts_of
from kvtune.profile.argv_text import NO_VARIABLE_REFERENCE, VARIABLE_REFERENCE, variable_reference_problem
from kvtune.profile.fields import argv_fields
from tests.helm_chart import engine_container, manifests, render_error
from tests.helpers import default_profile_data

REPO = Path(__file__).resolve().parents[1]
PROBE = "kvtune-probe-7c1e"
# A made-up token in the environment kvtune runs in, named by the profile's secret_env: never shown.
PLANTED = "hf_plantedArgvSecret0123456789abcdef"
TAILS = st.sampled_from(["", "HF_TOKEN)", "HF_TOKEN", ")", "X"])


def _members(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, type(int | None)):
        return [member for arg in args for member in _members(arg)]
    return [annotation]


def _text_value(annotation: Any) -> Any:
    """A value of ANNOTATION holding PROBE as text; None when the annotation holds no free text."""
    for member in _members(annotation):
        origin = typing.get_origin(member)
        if member in (str, Path) or (
            origin is typing.Literal and all(isinstance(arg, str) for arg in typing.get_args(member))
        ):
            return PROBE
        if origin is list and typing.get_args(member) == (str,):
            return [PROBE]
        if origin is dict and typing.get_args(member) == (str, str):
            return {"K": PROBE}
    return None


TEXT_FIELDS = {
    name: value
    for name, info in EngineProfile.model_fields.items()
    if (value := _text_value(info.annotation)) is not None
}
# Every text field whose value reaches argv, by the field table.
ARGV_TEXT_FIELDS = tuple(field for field in argv_fields(EngineProfile) if field in TEXT_FIELDS)
CHART_ARGV_TEXT_FIELDS = tuple(field for field in ARGV_TEXT_FIELDS if field in chart_fields(EngineProfile))


def _profile_data() -> dict[str, Any]:
    """The shipped CPU profile with every text field that reaches argv set, and a secret it names."""
    return default_profile_data(
        served_model_name="served",
        revision="main",
        extra_args=["--seed", "1"],
        secret_env=["HF_TOKEN"],
    )


@pytest.fixture(autouse=True, scope="module")
def planted_secret() -> Iterator[None]:
    before = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = PLANTED
    yield
    if before is None:
        del os.environ["HF_TOKEN"]
    else:
        os.environ["HF_TOKEN"] = before


# ---- which fields: the field table against what the profile renders -------------------------------------


def test_the_fields_whose_text_reaches_argv_are_those_the_field_table_names() -> None:
    base = EngineProfile(model="org/m", device="cuda", served_model_name="s", kv_events_port=5557)
    rendered = {
        field
        for field, value in TEXT_FIELDS.items()
        if PROBE in " ".join(base.model_copy(update={field: value}).vllm_args())
    }
    assert rendered == set(ARGV_TEXT_FIELDS)
    assert {"model", "served_model_name", "host", "revision", "name", "extra_args"} <= rendered
    assert "api_key_env" not in rendered and facts_of(EngineProfile)["api_key_env"].flag == "api-key"


# ---- the rule, and its pattern ------------------------------------------------------------------------


@given(text=st.text(alphabet=st.sampled_from("$(a)\n$"), max_size=12) | st.text(max_size=20))
def test_the_schema_pattern_says_what_the_profile_rule_says(text: str) -> None:
    assert (re.fullmatch(NO_VARIABLE_REFERENCE, text) is not None) == (VARIABLE_REFERENCE not in text)
    assert (variable_reference_problem("f", [text]) is None) == (VARIABLE_REFERENCE not in text)


@st.composite
def with_reference(draw: st.DrawFn, fields: tuple[str, ...], base: dict[str, Any]) -> tuple[str, Any, str]:
    """A field, its value with `$(` (and perhaps a variable's name) inserted anywhere, and the path the
    refusal must name."""
    field = draw(st.sampled_from(fields))
    value = base.get(field) or "x"
    reference = VARIABLE_REFERENCE + draw(TAILS)
    if isinstance(value, list):
        index = draw(st.integers(0, len(value) - 1))
        word = value[index]
        at = draw(st.integers(0, len(word)))
        return field, [*value[:index], word[:at] + reference + word[at:], *value[index + 1 :]], f"[{index}]"
    text = str(value)
    at = draw(st.integers(0, len(text)))
    return field, text[:at] + reference + text[at:], ""


def _render(data: dict[str, Any], *flags: str) -> tuple[int, str, str]:
    """`kvtune render` of DATA as a profile file: exit code, stdout, stderr."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "p.yaml")
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["render", str(path), *flags])
    return code, out.getvalue(), err.getvalue()


# ---- the profile and `kvtune render` ------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=with_reference(ARGV_TEXT_FIELDS, _profile_data()))
def test_a_reference_in_any_text_that_reaches_argv_is_refused_naming_the_field(
    case: tuple[str, Any, str],
) -> None:
    field, value, item = case
    data = _profile_data()
    code, out, err = _render(data)
    assert code == 0, err  # the same profile without the reference renders
    code, out, err = _render(data | {field: value})
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert lines[0].endswith("invalid EngineProfile:") and len(lines) == 2, err
    assert re.match(rf"  {field}{re.escape(item)}: ", lines[1]), err
    assert "Traceback" not in err and out == ""
    assert PLANTED not in out + err


@pytest.mark.parametrize("flags", [[], ["--as", "helm-values"]], ids=["argv", "helm-values"])
def test_the_command_line_refuses_a_secret_s_reference_and_never_shows_the_secret(
    tmp_path: Path, flags: list[str]
) -> None:
    data = _profile_data() | {"served_model_name": "$(HF_TOKEN)"}
    assert_render_refuses_unseen(tmp_path, data, flags, "served_model_name: holds '$('")


def assert_render_refuses_unseen(
    tmp_path: Path, data: dict[str, Any], flags: list[str], expected: str
) -> None:
    """`kvtune render` of profile DATA (HF_TOKEN planted in its environment): exit 2, one refusal holding
    EXPECTED, no traceback, nothing written and the planted secret nowhere."""
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "render", str(path), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
        env=os.environ | {"HF_TOKEN": PLANTED},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in " ".join(done.stderr.split()), done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert PLANTED not in done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == [path]  # nothing written


# ---- the chart's schema, through Helm's engine --------------------------------------------------------


def test_the_chart_schema_states_the_rule_on_every_engine_text_that_reaches_argv() -> None:
    engine = values_schema()["properties"]["engine"]["properties"]
    free_text = [field for field in CHART_ARGV_TEXT_FIELDS if "enum" not in engine[to_camel(field)]]
    assert {"model", "served_model_name", "revision", "extra_args"} <= set(free_text)
    for field in free_text:
        schema = engine[to_camel(field)]
        assert (schema.get("items") or schema)["pattern"] == NO_VARIABLE_REFERENCE, field


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=with_reference(
        CHART_ARGV_TEXT_FIELDS,
        {
            field: chart_values(EngineProfile.model_validate(_profile_data()))["engine"][to_camel(field)]
            for field in CHART_ARGV_TEXT_FIELDS
        },
    ),
    in_engines=st.booleans(),
)
def test_the_chart_refuses_a_reference_in_any_engine_text_that_reaches_argv(
    case: tuple[str, Any, str], in_engines: bool
) -> None:
    field, value, item = case
    engine = {to_camel(field): value}
    where = f"/engine/{to_camel(field)}"
    if in_engines:
        values: dict[str, Any] = {"engines": [{"name": "a", "engine": {"model": "m"} | engine}]}
        where = "/engines/0" + where
    else:
        values = {"engine": engine}
    message = render_error(values)
    index = item.strip("[]")
    assert f"at '{where}{'/' + index if index else ''}'" in message, message


def test_the_chart_renders_dollars_and_parentheses_apart() -> None:
    values = {"engine": {"servedModelName": "a$b$$(", "extraArgs": ["--seed", "1"]}}
    assert "does not match pattern" in render_error(values)
    values = {
        "engine": {"servedModelName": "price$", "extraArgs": ["--seed", "$1", "--chat-template", "(a)$"]}
    }
    args = engine_container(manifests(values))["args"]
    assert "price$" in args and args[-4:] == ["--seed", "$1", "--chat-template", "(a)$"], args
