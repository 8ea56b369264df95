"""What vLLM's own argument parser makes of the words in a profile's extra_args, without importing vLLM.

vLLM's api_server parser is argparse with abbreviations allowed, behind FlexibleArgumentParser's rewriting,
so `--por 9`, `--port=9`, `--kv_cache_dtype fp8`, `--no-enable-prefix-caching` and `--compilation-config.mode
3` all name a setting by another spelling. The parser is rebuilt here from vLLM's flag table
(kvtune.vllm_flags: each option's strings and whether it takes a value), so argparse itself matches options
and abbreviations as it does inside vLLM, and FlexibleArgumentParser's rewriting is done as vLLM's does it.
Each word then resolves to the setting (argparse destination) vLLM would set with it, so a rule on settings
holds for every spelling; a test checks every option against vLLM's own full parse.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from kvtune import vllm_flags
from kvtune.vllm_flags import FlagTable, Setting

__all__ = ["ExtraArgError", "Flag", "Setting", "VllmParser", "parser"]

_CANDIDATES_SHOWN = 8
# FlexibleArgumentParser (vLLM 0.32.0, vllm/utils/argparse_utils.py) reads `_` as `-` in a long flag's name
# up to its first `.`, `-O3` / `-O=3` as `--optimization-level 3` (`-O` too before a level 0-3), and
# `--flag.key VALUE` (`-x.key` too, `+` at the end appending) as `--flag` with a JSON value.
_NAME_AFTER_DASHES = re.compile(r"(?<=--)[^\.]*")
_OPTIMIZATION_LEVEL = "--optimization-level"
_SPACED_LEVELS = frozenset({"0", "1", "2", "3"})


class ExtraArgError(ValueError):
    """A word vLLM's parser would refuse (unknown, ambiguous) or treat otherwise than as a flag."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"extra_args[{index}]: {message}")
        self.index = index


@dataclass(frozen=True)
class Flag:
    """A word of extra_args that vLLM reads as a flag, and the setting it sets."""

    index: int
    text: str  # as written
    setting: Setting
    option_string: str  # the option it resolved to, e.g. "--no-enable-prefix-caching"
    inline_value: bool  # `--flag=value` (or a short flag with the value attached)


class _ParserError(Exception):
    """argparse's error() raised instead of printing usage and exiting."""


class _Rebuilt(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ParserError(message)


class VllmParser:
    """vLLM's api_server argument parser, rebuilt from its flag table and asked one word at a time."""

    def __init__(self, table: FlagTable) -> None:
        self.version: str = table.vllm
        self._parser = _Rebuilt(
            prog="vllm", add_help=False, allow_abbrev=table.allow_abbrev, prefix_chars=table.prefix_chars
        )
        self._settings: dict[int, Setting] = {}
        for index, setting in enumerate(table.settings):
            # Only the option strings and whether a value follows matter to how a word is matched.
            dest = f"setting_{index}"
            if setting.takes_value:
                action = self._parser.add_argument(*setting.option_strings, dest=dest, nargs=setting.nargs)
            else:
                action = self._parser.add_argument(
                    *setting.option_strings, dest=dest, action="store_const", const=True
                )
            self._settings[id(action)] = setting

    # ---- the parser's settings --------------------------------------------------------------------------

    def settings(self) -> list[Setting]:
        """Every setting an option of the parser sets (positionals such as the model tag left out)."""
        return [self._settings[id(a)] for a in self._parser._actions if a.option_strings]

    def option_strings(self) -> list[str]:
        return list(self._parser._option_string_actions)

    # ---- one word --------------------------------------------------------------------------------------

    def rewritten(self, word: str, following: str | None = None) -> str:
        """The word argparse sees for WORD once FlexibleArgumentParser has rewritten it (underscores to
        dashes, `--flag.key` to `--flag`, `-O3` to `--optimization-level`); FOLLOWING is the word after it."""
        if word.startswith("--help="):  # vLLM's search of its help for a keyword
            return "--help"
        if word.startswith("--"):
            name, equals, value = word.partition("=")
            dashed = _NAME_AFTER_DASHES.sub(lambda m: m.group(0).replace("_", "-"), name, count=1)
            word = dashed + equals + value
        elif word.startswith("-O") and (word != "-O" or following in _SPACED_LEVELS):
            return _OPTIMIZATION_LEVEL
        name = word.split("=", 1)[0]
        if word.startswith("-") and "." in name:
            return name.removesuffix("+").split(".", 1)[0]
        return word

    def resolve(self, word: str, following: str | None = None) -> tuple[Setting, str, bool] | None:
        """The setting vLLM reads WORD as, the option it matched and whether the value is attached; None
        for a word that is not a flag (a value, a negative number). _ParserError when ambiguous;
        LookupError(rewritten word) when no option matches."""
        if not word.startswith(tuple(self._parser.prefix_chars)):
            return None  # argparse's own rule: a positional, or a value (and nothing rewrites it)
        rewritten = self.rewritten(word, following)
        parsed = self._parser._parse_optional(rewritten)
        if isinstance(parsed, list):  # Python 3.12.7+: a list of one match
            (parsed,) = parsed
        if parsed is None:
            return None
        action, option_string, explicit = parsed[0], parsed[1], parsed[-1]
        if action is None:
            raise LookupError(rewritten)
        return self._settings[id(action)], option_string, explicit is not None

    def candidates(self, word: str) -> list[str]:
        """The options an ambiguous abbreviation could be, as argparse lists them."""
        return [match[1] for match in self._parser._get_option_tuples(self.rewritten(word))]

    # ---- a list of words ------------------------------------------------------------------------------

    def flags(self, args: Sequence[str]) -> list[Flag]:
        """Each word of ARGS that vLLM reads as a flag, with its setting; ExtraArgError naming the first
        word vLLM would refuse (no such flag, an ambiguous abbreviation) or that ends its flags (`--`)."""
        found: list[Flag] = []
        for index, word in enumerate(args):
            if word == "--":
                raise ExtraArgError(
                    index,
                    "'--' ends vLLM's flags: it would read every word after it as the model, not as a "
                    "flag; remove it",
                )
            following = args[index + 1] if index + 1 < len(args) else None
            try:
                resolved = self.resolve(word, following)
            except _ParserError:
                shown = self.candidates(word)
                more = f" and {len(shown) - _CANDIDATES_SHOWN} more" if len(shown) > _CANDIDATES_SHOWN else ""
                raise ExtraArgError(
                    index,
                    f"{word.split('=', 1)[0]!r} is ambiguous to vLLM {self.version}: it could be "
                    f"{', '.join(shown[:_CANDIDATES_SHOWN])}{more}; write the flag in full",
                ) from None
            except LookupError as unknown:
                raise ExtraArgError(index, self._unknown(word, str(unknown))) from None
            if resolved is not None:
                setting, option_string, inline = resolved
                found.append(Flag(index, word, setting, option_string, inline))
        return found

    def _unknown(self, word: str, rewritten: str) -> str:
        flag = rewritten.split("=", 1)[0]
        close = difflib.get_close_matches(flag, self.option_strings(), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; remove it or correct its spelling"
        return f"vLLM {self.version} has no flag {word.split('=', 1)[0]!r}{hint}"

    # ---- every spelling, for the chart's schema --------------------------------------------------------

    def spelling_pattern(self, dests: Iterable[str]) -> str:
        """A regular expression (RE2 and ECMA alike) matching every word vLLM reads as one of DESTS: each
        unambiguous abbreviation of each of their options, with `_` for any `-` after the leading `--`,
        followed by nothing, `=value` or `.key...`."""
        wanted = set(dests)
        alternatives = [
            self._option_pattern(option_string, setting)
            for setting in self.settings()
            if setting.dest in wanted
            for option_string in setting.option_strings
        ]
        return "^(?:" + "|".join(alternatives) + ")$"

    def _option_pattern(self, option_string: str, setting: Setting) -> str:
        if len(option_string) == 2:
            return self._short_option_pattern(option_string, setting)
        # `--name` or a single-dash one such as `-tp`: abbreviated down to its shortest unambiguous prefix
        # (`-t`), with `=value` or `.key` after it.
        dashes = 2 if option_string.startswith("--") else 1
        lengths = [
            length
            for length in range(dashes + 1, len(option_string) + 1)
            if self._reads_as(option_string[:length], setting)
        ]
        if not lengths or lengths != list(range(lengths[0], len(option_string) + 1)):
            raise RuntimeError(
                f"the abbreviations of {option_string} vLLM accepts are not one run {lengths}: "
                "extend kvtune.vllm_parser.spelling_pattern"
            )
        shortest = option_string[: lengths[0]]
        optional = "".join(f"(?:{_char(c)}" for c in option_string[lengths[0] :])
        tail = ")?" * (len(option_string) - lengths[0])
        head = "-" * dashes + "".join(_char(c) for c in shortest[dashes:])
        return head + optional + tail + r"(?:[=.][\s\S]*)?"

    def _short_option_pattern(self, option_string: str, setting: Setting) -> str:
        # A two-letter short option takes its value attached (`-hX`); argparse then matches it unless a
        # longer option starts the same way, which would make the word ambiguous.
        if any(other != option_string and other.startswith(option_string) for other in self.option_strings()):
            raise RuntimeError(
                f"extend kvtune.vllm_parser.spelling_pattern for {setting.dest}'s {option_string}"
            )
        return _literal(option_string) + r"[\s\S]*"

    def _reads_as(self, word: str, setting: Setting) -> bool:
        try:
            resolved = self.resolve(word)
        except (_ParserError, LookupError):
            return False
        return resolved is not None and resolved[0] == setting


def _char(c: str) -> str:
    """FlexibleArgumentParser reads `_` as `-` in a flag's name."""
    return "[-_]" if c == "-" else _literal(c)


def _literal(text: str) -> str:
    # Not re.escape: its `\-` is an error in the ECMA regular expressions some schema validators use.
    return "".join(c if c.isalnum() or c == "-" else re.escape(c) for c in text)


@functools.cache
def parser() -> VllmParser:
    """vLLM's parser as its committed flag table describes it, built once (milliseconds; vLLM is not
    imported)."""
    return VllmParser(vllm_flags.load())
