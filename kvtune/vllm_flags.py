"""vLLM's server flags as data: kvtune/vllm_flags.json, read from the installed vLLM's own argument parser by
`make generate` and committed beside this module.

Judging a profile's extra_args needs only each option's strings and whether it takes a value; reading them
from vLLM's parser means importing vLLM and torch, which made `kvtune render` of a profile with extra_args
take 14-18 s and 657 MB (a 2-core host, vLLM 0.32.0); from the table it takes 0.5 s and 48 MB, the same as
a profile without. The table also keeps each setting's choices and type, so a value vLLM would refuse could
be judged too. A test regenerates it from the installed vLLM and compares, so it cannot fall behind the
vLLM kvtune is tested with; a profile is judged by this table whichever vLLM runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvtune.documents import read_json

TABLE_PATH = Path(__file__).with_name("vllm_flags.json")
ABOUT = (
    "vLLM's api_server flags, read from its own argument parser by `make generate` (kvtune/vllm_flags.py); "
    "do not edit."
)

# A choice as argparse compares it: vLLM's are text, numbers or None (an unset optional value).
Choice = str | int | float | bool | None


class Setting(BaseModel):
    """One setting of vLLM's server, as its parser knows it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dest: str = Field(description='argparse\'s destination, e.g. "port", "api_key"; "help" for -h/--help.')
    name: str = Field(description='Its first long option, e.g. "--port".')
    option_strings: tuple[str, ...] = Field(description="Every option that sets it, as registered.")
    nargs: int | str | None = Field(
        description="argparse's nargs: 0 for a switch (--enforce-eager), None for one value, '?' or '+'."
    )
    choices: tuple[Choice, ...] | None = Field(description="The values vLLM accepts, when it lists them.")
    type: str | None = Field(
        description="The function vLLM converts the value with: int, float, str, 'X | None' (empty or None "
        "is None), or the name of a function of vLLM's own (e.g. loads for JSON)."
    )

    @property
    def takes_value(self) -> bool:
        """False for switches such as --enforce-eager / --no-enforce-eager."""
        return self.nargs != 0


class FlagTable(BaseModel):
    """vLLM's api_server parser written down: what argparse needs to read a word as vLLM would."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    about: str = Field(description="What the file is and where it comes from.")
    vllm: str = Field(description="The vLLM version the table was read from.")
    prefix_chars: str = Field(description="argparse's prefix characters.")
    allow_abbrev: bool = Field(description="Whether argparse reads an unambiguous prefix as the option.")
    settings: tuple[Setting, ...] = Field(description="Each setting an option sets, in the parser's order.")


@functools.cache
def load() -> FlagTable:
    """The committed table, read once per process."""
    return FlagTable.model_validate(read_json(TABLE_PATH, "vLLM's flag table"))


def render(table: FlagTable) -> str:
    """The table as its committed file: one setting a line, so a vLLM upgrade reads as a short diff."""
    head = table.model_dump(mode="json", exclude={"settings"})
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}," for key, value in head.items()]
    rows = [json.dumps(setting.model_dump(mode="json")) for setting in table.settings]
    return "{\n" + "\n".join(lines) + '\n  "settings": [\n    ' + ",\n    ".join(rows) + "\n  ]\n}\n"


def from_installed_vllm() -> FlagTable:
    """The table read from the installed vLLM's api_server parser (imports vLLM and torch: seconds)."""
    with _vllm_logs_quiet():
        from vllm import __version__
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = make_arg_parser(FlexibleArgumentParser(description="vLLM's api_server"))  # type: ignore[no-untyped-call]
    return FlagTable(
        about=ABOUT,
        vllm=__version__.split("+")[0],
        prefix_chars=parser.prefix_chars,
        allow_abbrev=parser.allow_abbrev,
        # Positionals (the model tag) left out: extra_args are judged as flags.
        settings=tuple(_setting(action) for action in parser._actions if action.option_strings),
    )


def _setting(action: argparse.Action) -> Setting:
    long = [option for option in action.option_strings if option.startswith("--")]
    name = (long or list(action.option_strings))[0]
    dest = name.lstrip("-").replace("-", "_") if action.dest == argparse.SUPPRESS else action.dest
    choices = None if action.choices is None else tuple(sorted(map(_choice, action.choices), key=json.dumps))
    return Setting(
        dest=dest,
        name=name,
        option_strings=tuple(action.option_strings),
        nargs=action.nargs,
        choices=choices,
        type=_type_name(action.type),
    )


def _choice(value: Any) -> Choice:
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)


def _type_name(kind: Any) -> str | None:
    """An argparse type as text, the same in every process (never a function's address): a class by name,
    vLLM's optional_type(X) as "X | None" and parse_type(X) as X, another function by its name."""
    if kind is None:
        return None
    if isinstance(kind, type):
        return kind.__name__
    name = str(getattr(kind, "__name__", type(kind).__name__))
    wrapped = [cell.cell_contents for cell in getattr(kind, "__closure__", None) or ()]
    inner = next((item for item in wrapped if callable(item)), None)
    if name == "_optional_type" and inner is not None:
        return f"{_type_name(inner)} | None"
    if name == "_parse_type" and inner is not None:
        return _type_name(inner)
    return name


@contextlib.contextmanager
def _vllm_logs_quiet() -> Iterator[None]:
    """Importing vLLM logs what it finds of the host (Triton's drivers...), which says nothing of flags."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        vllm_logger.setLevel(level)
