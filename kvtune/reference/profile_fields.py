"""reference/profile.md: every engine profile field, from the model itself. Its type, default, bounds and
description come from the field's JSON Schema and FieldInfo; the vLLM flag or environment variable it
renders to, its key in the chart's `engine` section (or why the chart does not carry it) and whether a sweep
may vary it come from its FieldFacts (kvtune.profile.fields), the table argv, the chart and the sweep are
derived from too."""

from __future__ import annotations

from pydantic import BaseModel
from pydantic.alias_generators import to_camel

from kvtune.profile import EngineProfile, FieldFacts, facts_of
from kvtune.reference import markdown, model_fields, schema_text

SOURCE = "kvtune/profile/model.py and kvtune/profile/fields.py"
# The chart's section that carries the profile (kvtune.helm.values: the profile under camelCase names).
CHART_SECTION = "engine"
FACTS_HEADER = ("Type", "Default", "Bounds", "vLLM flag or variable", "Chart key", "Sweep knob")


def flag_text(facts: FieldFacts) -> str:
    """Where the field reaches vLLM: `--flag`, an environment variable, or each entry as a variable."""
    if facts.flag and not facts.reaches_argv:  # the API key: vLLM reads it from its environment instead
        return f"`--{facts.flag}`, given as an environment variable, never on the command line"
    if facts.flag:
        return f"`--{facts.flag}`"
    if facts.env:
        return f"`{facts.env}` (environment)"
    if facts.env_map:
        return "each entry, as an environment variable"
    return ""


def chart_key(name: str, facts: FieldFacts) -> str:
    """The field's key in the chart's values, or the FieldFacts text saying what stands for it in a pod."""
    return f"`{CHART_SECTION}.{to_camel(name)}`" if facts.chart is True else facts.chart


def render(profile_class: type[BaseModel] = EngineProfile) -> str:
    schema = profile_class.model_json_schema()
    definitions = schema.get("$defs", {})
    facts = facts_of(profile_class)
    lines = markdown.page_head(
        "Engine profile",
        "Every field of an engine profile (the YAML file `kvtune up`, `kvtune render` and a sweep's "
        "`base_profile` read): its type, default, bounds and meaning, the vLLM flag or environment variable "
        "it renders to, its key in the Helm chart's `engine` values, and whether a sweep may vary it.",
        SOURCE,
    )
    lines += [
        "A profile is strict: a key that is not a field below is refused with its name, and so is a value "
        "outside a field's bounds.",
        "",
        *markdown.table(
            ("Field", "vLLM flag or variable", "Chart key", "Sweep knob"),
            (
                [
                    markdown.link(markdown.code(name), markdown.anchor(name)),
                    markdown.cell(flag_text(fact)),
                    markdown.cell(chart_key(name, fact)),
                    _yes(fact.knob),
                ]
                for name, fact in facts.items()
            ),
        ),
        "",
    ]
    for name, info in profile_class.model_fields.items():
        prop = schema["properties"][name]
        fact = facts[name]
        lines += [
            markdown.heading(2, markdown.code(name), markdown.anchor(name)),
            "",
            markdown.cell(model_fields.description(prop, definitions)),
            "",
            *markdown.table(
                FACTS_HEADER,
                [
                    [
                        markdown.cell(schema_text.type_text(prop, definitions)),
                        markdown.cell(schema_text.default_text(info)),
                        markdown.cell(schema_text.bounds_text(prop, definitions)),
                        markdown.cell(flag_text(fact)),
                        markdown.cell(chart_key(name, fact)),
                        _yes(fact.knob),
                    ]
                ],
            ),
            "",
        ]
        # A field holding documents of their own (warm-up prefixes): their fields, under the field.
        for step, model in model_fields.nested_models(info.annotation):
            for section in model_fields.sections(model, f"{name}{step}"):
                lines += model_fields.section_lines(section, 3)
    return markdown.page(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"
