"""reference/cli.md: every `kvtune` subcommand (nested ones too) and every flag, read from the argparse parser
`kvtune` itself builds (`kvtune.cli.build_parser()`, every subcommand loaded).

The page is built from the parser's actions, never from `--help` output, whose wrapping follows the terminal:
the usage line is argparse's own at a fixed width, and each flag is a table row (flags, value, default,
choices, help with its `%(default)s` filled in as argparse fills it)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

from kvtune import cli
from kvtune.reference import markdown

SOURCE = "kvtune/cli.py and kvtune/commands/ (the argparse parser)"
# The usage block's width: fixed, so the page is the same whatever terminal renders it.
USAGE_WIDTH = 100
HEADER = ("Flag", "Value", "Default", "Choices", "Help")


@dataclass(frozen=True)
class Command:
    """One parser of the command line: `kvtune`, `kvtune sweep`, `kvtune trace curve`."""

    words: tuple[str, ...]
    parser: argparse.ArgumentParser
    help: str

    @property
    def name(self) -> str:
        return " ".join(self.words)

    @property
    def fragment(self) -> str:
        return markdown.anchor(self.name)


def subparsers_of(
    parser: argparse.ArgumentParser,
) -> list[argparse._SubParsersAction[argparse.ArgumentParser]]:
    return [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]


def children(command: Command) -> list[Command]:
    """The subcommands COMMAND's parser takes, in the order they were added (aliases once)."""
    found: list[Command] = []
    for action in subparsers_of(command.parser):
        helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
        seen: set[int] = set()
        for name, parser in action.choices.items():
            if id(parser) in seen:
                continue
            seen.add(id(parser))
            found.append(Command((*command.words, name), parser, helps.get(name, parser.description or "")))
    return found


def commands(parser: argparse.ArgumentParser) -> Iterator[Command]:
    """PARSER's command and every subcommand under it, each before its own subcommands."""
    stack = [Command((parser.prog,), parser, parser.description or "")]
    while stack:
        command = stack.pop(0)
        yield command
        stack[:0] = children(command)


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags and positional arguments a page lists: not -h (every parser has it), not a subcommand
    choice (listed as a subcommand), not one whose help is suppressed."""
    return [
        action
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
    ]


def usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip("\n")


def flag_row(parser: argparse.ArgumentParser, action: argparse.Action) -> list[str]:
    formatter = argparse.HelpFormatter(parser.prog, width=USAGE_WIDTH)
    if action.option_strings:
        flags = ", ".join(markdown.code(option) for option in action.option_strings)
        metavar = action.dest.upper()
    else:
        flags = markdown.code(str(action.metavar or action.dest))
        metavar = action.dest
    value = "" if action.nargs == 0 else markdown.code(formatter._format_args(action, metavar))
    choices = (
        ", ".join(markdown.code(str(choice)) for choice in action.choices)
        if action.choices is not None
        else ""
    )
    help_text = formatter._expand_help(action) if action.help else ""
    return [flags, value, _default(action), choices, markdown.cell(help_text)]


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    default = action.default
    if action.nargs == 0 or default is None or default == argparse.SUPPRESS:
        return ""  # a switch: off unless given
    if isinstance(default, list | tuple):
        return markdown.code(" ".join(str(item) for item in default)) if default else ""
    return markdown.code(str(default)) or '`""`'


def section(command: Command) -> list[str]:
    level = min(max(2, len(command.words)), 4)
    lines = [markdown.heading(level, markdown.code(command.name), command.fragment), ""]
    description = command.parser.description or command.help
    if description:
        lines += [markdown.cell(description), ""]
    lines += ["```text", usage(command.parser), "```", ""]
    subcommands = children(command)
    if subcommands:
        lines += [
            *markdown.table(
                ("Subcommand", "What it does"),
                ([markdown.link(markdown.code(child.name), child.fragment), markdown.cell(child.help)]
                 for child in subcommands),
            ),
            "",
        ]  # fmt: skip
    actions = documented_actions(command.parser)
    if actions:
        lines += [*markdown.table(HEADER, (flag_row(command.parser, action) for action in actions)), ""]
    if command.parser.epilog:
        lines += [markdown.cell(command.parser.epilog), ""]
    return lines


def render(parser: argparse.ArgumentParser | None = None) -> str:
    parser = parser or cli.build_parser()
    lines = markdown.page_head(
        "Command line",
        "Every `kvtune` subcommand and every flag it takes: usage, what it does, and a table of its flags "
        "(value, default, choices, help).",
        SOURCE,
    )
    lines += ["Every command also takes `-h` / `--help`, which prints its usage and flags.", ""]
    for command in commands(parser):
        lines += section(command)
    return markdown.page(lines)
