"""Text that reaches an engine's command line or environment holds no `$(`: Kubernetes expands `$(NAME)` in a
container's args and env values from the container's environment, so `served_model_name: "$(HF_TOKEN)"`
beside `secret_env: [HF_TOKEN]` would put the token on the command line and list it as the model id in every
/v1/models answer, and `env: {X: "$(HF_TOKEN)"}` would copy it into a variable nobody treats as a secret.

Refused by name (the profile, `kvtune render`, the chart's schema) rather than escaped as `$$(`: no model id,
served name, address, revision, vLLM flag or engine variable needs the text, a user who wrote `$(VAR)`
meaning it to be expanded learns that it will not be (`kvtune up` expands nothing, a pod would: refused,
the value means one thing in both), and one rule at the profile and the schema covers every place the
values go (the chart's templates, a sweep's values, manifests users write from `kvtune render --as
helm-values`), where an escape would have to be repeated by each of them. The chart's own values that
reach a container's args or env (a folder on the model volume, a ZMQ address, Locust's options) take the
same pattern from here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal

# Where in a container the text goes: its args (the command line) or the value of one of its env variables.
Place = Literal["args", "env"]
_PLACES: dict[Place, str] = {"args": "a container's args", "env": "a container's env values"}

VARIABLE_REFERENCE = "$("
# The same rule as a JSON Schema pattern, read alike by RE2 (Helm's validator is Go's) and ECMA: no
# look-ahead, so any text without "$(" spelt out.
NO_VARIABLE_REFERENCE = r"^(?:[^$]|\$+[^$(])*\$*$"


def variable_reference_problem(field: str, value: Any, place: Place = "args") -> str | None:
    """Why VALUE of FIELD may not reach a container's PLACE, naming the item (`extra_args[2]`, `env.NAME`);
    None when it may. The value itself is never shown."""
    for where, text in _texts(field, value):
        if VARIABLE_REFERENCE in text:
            return (
                f"{where}: holds '$(', which Kubernetes replaces in {_PLACES[place]} with the value of an "
                "environment variable (a secret listed in secret_env included); remove it"
            )
    return None


def _texts(where: str, value: Any) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _texts(f"{where}[{index}]", item)
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _texts(f"{where}.{key}", item)
