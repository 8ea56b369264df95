"""No text that becomes the value of an engine's environment variable holds `$(`: Kubernetes expands
`$(NAME)` in a container's env values from the variables before it, so `env: {COPY: "$(HF_TOKEN)"}` beside
`secret_env: [HF_TOKEN]` would copy the token into a variable nobody treats as a secret (and into whatever
logs it). The profile, `kvtune render` and the chart's schema refuse it naming the variable, never showing
the value.

The fields are not listed here: they are those whose FieldFacts say their text reaches the environment, and
a test renders every field of the profile to check the facts say so exactly. Keys and values are generated:
`$(` inserted anywhere in a value the profile otherwise accepts, under any variable name it accepts.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvtune.cli import main as cli_main
from kvtune.config_errors import ConfigError
from kvtune.credentials import looks_secret, value_looks_secret
from kvtune.helm.values import values_schema
from kvtune.profile import EngineProfile, load_profile
from kvtune.profile.argv_text import NO_VARIABLE_REFERENCE, VARIABLE_REFERENCE
from kvtune.profile.fields import env_fields, managed_env
from tests.helm_chart import engine_container, manifests, render_error
from tests.helpers import default_profile_data
from tests.test_argv_text import TEXT_FIELDS, assert_render_refuses_unseen

REPO = Path(__file__).resolve().parents[1]
PROBE = "kvtune-probe-7c1e"
# A made-up token in the environment kvtune runs in, named by the profile's secret_env: never shown.
PLANTED = "hf_plantedEnvSecret0123456789abcdef"
# Planted in every generated value: a refusal names the variable, never the value.
MARK = "envmark7f3a"
TAILS = st.sampled_from(["", "HF_TOKEN)", "HF_TOKEN", ")", "X"])
FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Helm renders in 30-100 ms in process: fewer examples, derandomized so a run is repeatable.
RENDERS = settings(FAST, max_examples=20, derandomize=True, database=None)

NAMES = st.from_regex(r"\A[A-Z_][A-Z0-9_]{0,15}\Z").filter(
    lambda name: not looks_secret(name) and name not in managed_env(EngineProfile)
)


@st.composite
def referencing_values(draw: st.DrawFn) -> str:
    """A value the profile would take, with MARK in it and `$(` (perhaps a variable's name after it)
    inserted anywhere."""
    text = st.text(
        st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_categories=("Cs", "Cc")), max_size=12
    )
    base = draw(text) + MARK + draw(text)
    at = draw(st.integers(0, len(base)))
    value = base[:at] + VARIABLE_REFERENCE + draw(TAILS) + base[at:]
    assume(not value_looks_secret(value))
    return value


@pytest.fixture(autouse=True, scope="module")
def planted_secret() -> Iterator[None]:
    before = os.environ.get("HF_TOKEN")
    os.environ["HF_TOKEN"] = PLANTED
    yield
    if before is None:
        del os.environ["HF_TOKEN"]
    else:
        os.environ["HF_TOKEN"] = before


def _profile_data(**env: str) -> dict[str, Any]:
    return default_profile_data(env=env, secret_env=["HF_TOKEN"])


# ---- which fields: the field table against what the profile renders -------------------------------------


def test_the_fields_whose_text_reaches_the_environment_are_those_the_field_table_names() -> None:
    base = EngineProfile(model="org/m", device="cpu")
    rendered = {
        field
        for field, value in TEXT_FIELDS.items()
        if PROBE in " ".join(base.model_copy(update={field: value}).engine_env().values())
    }
    assert rendered == {field for field in env_fields(EngineProfile) if field in TEXT_FIELDS}
    assert "cpu_reserved_cores" in env_fields(EngineProfile)  # a number: no text to hold `$(`
    assert {"env", "cpu_threads_bind"} <= rendered


def test_the_chart_schema_states_the_rule_on_every_engine_text_that_reaches_the_environment() -> None:
    schema = values_schema()
    for engine in (
        schema["properties"]["engine"]["properties"],
        schema["properties"]["engines"]["items"]["properties"]["engine"]["properties"],
    ):
        assert engine["env"]["additionalProperties"]["pattern"] == NO_VARIABLE_REFERENCE
        assert engine["cpuThreadsBind"]["pattern"] == NO_VARIABLE_REFERENCE


# ---- the profile and `kvtune render` ------------------------------------------------------------------


@settings(FAST, max_examples=150)
@given(name=NAMES, value=referencing_values())
def test_the_profile_refuses_a_reference_in_any_env_value_naming_the_variable(name: str, value: str) -> None:
    data = _profile_data(**{name: value})
    EngineProfile.model_validate(data | {"env": {name: value.replace(VARIABLE_REFERENCE, "$ (")}})
    with pytest.raises(ValidationError) as caught:
        EngineProfile.model_validate(data)
    message = str(caught.value)
    assert f"env.{name}: holds '$('" in message, message
    assert MARK not in message and PLANTED not in message


def _render(data: dict[str, Any], *flags: str) -> tuple[int, str, str, list[str]]:
    """`kvtune render` of DATA as a profile file: exit code, stdout, stderr, the folder's files after."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "p.yaml")
        path.write_text(yaml.safe_dump(data), encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli_main(["render", str(path), *flags])
        files = sorted(child.name for child in Path(folder).iterdir())
    return code, out.getvalue(), err.getvalue(), files


@settings(FAST, max_examples=40)
@given(name=NAMES, value=referencing_values(), helm_values=st.booleans())
def test_kvtune_render_refuses_it_with_one_line_naming_the_variable(
    name: str, value: str, helm_values: bool
) -> None:
    flags = ["--as", "helm-values"] if helm_values else []
    code, out, err, files = _render(_profile_data(**{name: value}), *flags)
    assert code == 2, out + err
    lines = err.strip().splitlines()
    assert lines[0].endswith("invalid EngineProfile:") and len(lines) == 2, err
    assert lines[1].startswith(f"  env.{name}: holds '$('"), err
    assert "Traceback" not in err and out == "" and files == ["p.yaml"]
    assert MARK not in err and PLANTED not in err


def test_load_profile_names_the_variable(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_profile_data(COPY=f"$(HF_TOKEN) {MARK}")), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_profile(path)
    assert "env.COPY: holds '$('" in str(caught.value) and MARK not in str(caught.value)


@pytest.mark.parametrize("flags", [[], ["--as", "helm-values"]], ids=["argv", "helm-values"])
def test_the_command_line_refuses_a_copy_of_a_secret_and_never_shows_the_secret(
    tmp_path: Path, flags: list[str]
) -> None:
    assert_render_refuses_unseen(tmp_path, _profile_data(COPY="$(HF_TOKEN)"), flags, "env.COPY: holds '$('")


def test_a_dollar_apart_from_a_parenthesis_is_kept() -> None:
    env = {"PRICE": "$5", "TWO": "$$", "PAREN": "(a) $ (b)", "END": "a$"}
    assert EngineProfile.model_validate(_profile_data(**env)).engine_env().items() >= env.items()


# ---- the chart, through Helm's engine -----------------------------------------------------------------


@RENDERS
@given(name=NAMES, value=referencing_values(), in_engines=st.booleans())
def test_the_chart_refuses_a_reference_in_any_env_value_at_the_variable_s_path(
    name: str, value: str, in_engines: bool
) -> None:
    engine = {"env": {name: value}}
    if in_engines:
        values: dict[str, Any] = {"engines": [{"name": "a", "engine": {"model": "m"} | engine}]}
        where = f"/engines/0/engine/env/{name}"
    else:
        values, where = {"engine": engine}, f"/engine/env/{name}"
    message = render_error(values)
    assert f"at '{where}': " in message and "does not match pattern" in message, message
    assert PLANTED not in message


def test_the_chart_passes_other_dollars_into_the_pod_s_env() -> None:
    env = {"PRICE": "$5", "TWO": "$$", "PAREN": "(a) $ (b)"}
    container = engine_container(manifests({"engine": {"env": env}}))
    rendered = {item["name"]: item.get("value") for item in container["env"]}
    assert rendered.items() >= env.items()
