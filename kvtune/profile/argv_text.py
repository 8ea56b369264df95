"""Text that reaches an engine's command line holds no `$(`: Kubernetes expands `$(NAME)` in a container's
args from the container's environment, so `served_model_name: "$(HF_TOKEN)"` beside `secret_env: [HF_TOKEN]`
would put the token on the command line and list it as the model id in every /v1/models answer.

Refused by name (the profile, `kvtune render`, the chart's schema) rather than escaped as `$$(`: no model id,
served name, address, revision or vLLM flag needs the text, a user who wrote `$(VAR)` meaning it to be
expanded learns that it will not be, and one rule at the profile and the schema covers every place the
values go (the chart's templates, a sweep's values, manifests users write from `kvtune render --as
helm-values`), where an escape would have to be repeated by each of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

VARIABLE_REFERENCE = "$("
# The same rule as a JSON Schema pattern, read alike by RE2 (Helm's validator is Go's) and ECMA: no
# look-ahead, so any text without "$(" spelt out.
NO_VARIABLE_REFERENCE = r"^(?:[^$]|\$+[^$(])*\$*$"


def variable_reference_problem(field: str, value: Any) -> str | None:
    """Why VALUE of FIELD may not reach a container's args, naming the item (`extra_args[2]`); None when it
    may. The value itself is never shown."""
    for where, text in _texts(field, value):
        if VARIABLE_REFERENCE in text:
            return (
                f"{where}: holds '$(', which Kubernetes replaces in a container's args with the value of an "
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
