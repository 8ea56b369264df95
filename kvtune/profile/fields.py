"""What each profile field means outside the profile, written once beside the field.

Every `EngineProfile` field carries a `FieldFacts` in its annotation: the vLLM flag or environment variable it
renders to, whether the chart's `engine` section carries it (and what stands for it in a pod when not),
whether a sweep may vary it, and whether its text reaches the command line or the environment. The argv and
serve YAML, the flags extra_args may not repeat, the chart's engine values and flag table, the sweep's knobs
and the text that may hold no `$(` (in the profile and in every JSON Schema of the field) are all derived
from these facts, so a new field is added in one place.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue

from kvtune.profile.argv_text import NO_VARIABLE_REFERENCE

# A field's value read from the profile; None leaves the flag out of the command line.
FlagValue = Callable[[Any], Any]


@dataclass(frozen=True)
class FieldFacts:
    """One profile field's place outside the profile."""

    # True: the chart's engine section carries it (under its camelCase name); otherwise why it does not,
    # and what stands for it in a pod.
    chart: Literal[True] | str
    # The vLLM server flag this field sets; the same flag in extra_args is refused in any spelling.
    flag: str | None = None
    # The flag's value when it is not the field's own (e.g. left out at vLLM's default); None = the field's.
    flag_value: FlagValue | None = None
    # The environment variable of vLLM's this field sets (its value as text), when it is not a flag.
    env: str | None = None
    # A sweep may vary it (`space:` in a sweep spec).
    knob: bool = False
    # Its text reaches vLLM's command line (a flag's value, words of their own, part of another flag's
    # value); None: it does when it has a flag. A test renders each field to check it.
    argv: bool | None = None
    # Its entries are the engine's own environment variables, each value under its name (`env`).
    env_map: bool = False

    def value_in(self, profile: Any, field: str) -> Any:
        return self.flag_value(profile) if self.flag_value else getattr(profile, field)

    @property
    def reaches_argv(self) -> bool:
        return self.flag is not None if self.argv is None else self.argv

    @property
    def reaches_env(self) -> bool:
        """Its text is the value of an environment variable of the engine's."""
        return self.env is not None or self.env_map

    def __get_pydantic_json_schema__(
        self, core_schema: Any, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        """The field's JSON Schema (the chart's values.schema.json reuses the field): text that reaches argv
        or the environment states the profile's rule on `$(` as a pattern (kvtune.profile.argv_text)."""
        schema = handler(core_schema)
        return _without_variable_references(schema) if self.reaches_argv or self.reaches_env else schema


def _without_variable_references(schema: Any) -> Any:
    """SCHEMA with every free-text string in it (not an enum's) matching NO_VARIABLE_REFERENCE."""
    if isinstance(schema, list):
        return [_without_variable_references(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _without_variable_references(value) for key, value in schema.items()}
    if out.get("type") == "string" and not {"enum", "const"} & set(out):
        rule = {"pattern": NO_VARIABLE_REFERENCE}
        # A pattern of the field's own stays: both must match.
        out |= {"allOf": [*out.get("allOf", []), rule]} if "pattern" in out else rule
    return out


class MissingFacts(TypeError):
    """A profile field declared without its FieldFacts."""


@functools.cache
def facts_of(profile_class: type[BaseModel]) -> dict[str, FieldFacts]:
    """Each field of PROFILE_CLASS and its facts, in the order the fields are declared."""
    facts: dict[str, FieldFacts] = {}
    for name, info in profile_class.model_fields.items():
        found = [item for item in info.metadata if isinstance(item, FieldFacts)]
        if len(found) != 1:
            raise MissingFacts(
                f"{profile_class.__name__}.{name}: declare it as Annotated[type, FieldFacts(...)] "
                "(its flag, chart key and whether it is a sweep knob)"
            )
        facts[name] = found[0]
    return facts


@functools.cache
def managed_flags(profile_class: type[BaseModel]) -> dict[str, str]:
    """Each vLLM flag the profile sets itself, and the field that sets it."""
    return {fact.flag: name for name, fact in facts_of(profile_class).items() if fact.flag}


@functools.cache
def managed_env(profile_class: type[BaseModel]) -> dict[str, str]:
    """Each environment variable the profile sets from a field, and that field."""
    return {fact.env: name for name, fact in facts_of(profile_class).items() if fact.env}


@functools.cache
def chart_fields(profile_class: type[BaseModel]) -> tuple[str, ...]:
    """The fields the chart's `engine` section carries, in the profile's order."""
    return tuple(name for name, fact in facts_of(profile_class).items() if fact.chart is True)


@functools.cache
def chart_omissions(profile_class: type[BaseModel]) -> dict[str, str]:
    """The fields the chart does not carry, and what stands for each in a pod."""
    return {name: fact.chart for name, fact in facts_of(profile_class).items() if fact.chart is not True}


@functools.cache
def argv_fields(profile_class: type[BaseModel]) -> tuple[str, ...]:
    """The fields whose text reaches vLLM's command line, in the profile's order."""
    return tuple(name for name, fact in facts_of(profile_class).items() if fact.reaches_argv)


@functools.cache
def env_fields(profile_class: type[BaseModel]) -> tuple[str, ...]:
    """The fields whose text becomes the value of an environment variable, in the profile's order."""
    return tuple(name for name, fact in facts_of(profile_class).items() if fact.reaches_env)


@functools.cache
def knobs(profile_class: type[BaseModel]) -> tuple[str, ...]:
    """The fields a sweep may vary, in the profile's order."""
    return tuple(name for name, fact in facts_of(profile_class).items() if fact.knob)


def flag_options(profile: BaseModel) -> dict[str, Any]:
    """The profile's vLLM flags and their values, in field order; a flag whose value is None is left out."""
    options = {
        fact.flag: fact.value_in(profile, name) for name, fact in facts_of(type(profile)).items() if fact.flag
    }
    return {flag: value for flag, value in options.items() if value is not None}


def env_options(profile: BaseModel) -> dict[str, str]:
    """The environment variables the profile's fields set, in field order (unset fields left out)."""
    values = {fact.env: getattr(profile, name) for name, fact in facts_of(type(profile)).items() if fact.env}
    return {env: str(value) for env, value in values.items() if value is not None}
