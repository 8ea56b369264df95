"""What vLLM's own argument parser makes of the words in a profile's extra_args.

vLLM's api_server parser is argparse with abbreviations allowed, behind FlexibleArgumentParser's rewriting,
so `--por 9`, `--port=9`, `--kv_cache_dtype fp8`, `--no-enable-prefix-caching` and `--compilation-config.mode
3` all name a setting by another spelling. Each word is judged here by the parser itself, which says what
setting (argparse destination) vLLM would set with it, so a rule on settings holds for every spelling.

Building the parser imports vLLM (and torch): seconds, and about 600 MB. It is built on first use only (a
profile with extra_args, the chart's schema) and kept for the process.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import logging
import re
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# A word that carries its own value (`--flag=value`) is rewritten alone; another is rewritten with the word
# after it, as vLLM reads `--flag.key VALUE` and `-O 3`. This stands in for that word when it is a flag too,
# or missing: a plain word that no rewriting changes.
_PLACEHOLDER_VALUE = "x"
_CANDIDATES_SHOWN = 8


class ExtraArgError(ValueError):
    """A word vLLM's parser would refuse (unknown, ambiguous) or treat otherwise than as a flag."""

    def __init__(self, index: int, message: str) -> None:
        super().__init__(f"extra_args[{index}]: {message}")
        self.index = index


@dataclass(frozen=True)
class Setting:
    """One setting of vLLM's server, as its parser knows it."""

    dest: str  # argparse's destination, e.g. "port", "api_key"; "help" for -h/--help
    name: str  # its first long option, e.g. "--port"
    option_strings: tuple[str, ...]
    takes_value: bool  # False for switches such as --enforce-eager / --no-enforce-eager


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


class _Rewritten(argparse.Namespace):
    """Passed as the namespace to stop a parse once FlexibleArgumentParser has rewritten the words."""

    words: list[str]


class VllmParser:
    """vLLM's api_server argument parser, asked one word at a time."""

    def __init__(self) -> None:
        with _vllm_logs_quiet():
            from vllm import __version__
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser

        class JudgingParser(FlexibleArgumentParser):
            def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
                if isinstance(namespace, _Rewritten):
                    namespace.words = list(args)
                    return namespace, []
                return super().parse_known_args(args, namespace)  # type: ignore[no-untyped-call]

            def error(self, message: str) -> Any:
                raise _ParserError(message)

        self.version: str = __version__.split("+")[0]
        self._flexible = FlexibleArgumentParser
        judging = JudgingParser(description="vLLM's api_server")  # type: ignore[no-untyped-call]
        with _vllm_logs_quiet():
            self._parser = make_arg_parser(judging)
        # FlexibleArgumentParser keeps `--help=WORD` on its class: rewriting is serialised and that undone.
        self._lock = threading.Lock()
        self._settings = {id(action): _setting(action) for action in self._parser._actions}

    # ---- the parser's settings --------------------------------------------------------------------------

    def settings(self) -> list[Setting]:
        """Every setting an option of the parser sets (positionals such as the model tag left out)."""
        return [self._settings[id(a)] for a in self._parser._actions if a.option_strings]

    def option_strings(self) -> list[str]:
        return list(self._parser._option_string_actions)

    # ---- one word --------------------------------------------------------------------------------------

    def rewritten(self, word: str, following: str | None = None) -> str:
        """The word argparse sees for WORD once FlexibleArgumentParser has rewritten it (underscores to
        dashes, `--flag.key` to `--flag`, `-O3` to `--optimization-level`)."""
        if word == "--config":  # FlexibleArgumentParser would read the file it names
            return word
        if following is None or following.startswith("-"):
            following = _PLACEHOLDER_VALUE
        with self._lock:
            keyword = self._flexible._search_keyword
            try:
                namespace = self._parser.parse_args(
                    [word] if "=" in word else [word, following], namespace=_Rewritten()
                )
            finally:
                self._flexible._search_keyword = keyword
        words: list[str] = namespace.words
        return words[0]

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


def _setting(action: argparse.Action) -> Setting:
    long = [option for option in action.option_strings if option.startswith("--")]
    name = (long or list(action.option_strings) or [action.dest])[0]
    dest = name.lstrip("-").replace("-", "_") if action.dest == argparse.SUPPRESS else action.dest
    return Setting(dest, name, tuple(action.option_strings), action.nargs != 0)


def _char(c: str) -> str:
    """FlexibleArgumentParser reads `_` as `-` in a flag's name."""
    return "[-_]" if c == "-" else _literal(c)


def _literal(text: str) -> str:
    # Not re.escape: its `\-` is an error in the ECMA regular expressions some schema validators use.
    return "".join(c if c.isalnum() or c == "-" else re.escape(c) for c in text)


@functools.cache
def parser() -> VllmParser:
    """The installed vLLM's parser, built once (importing vLLM takes seconds)."""
    return VllmParser()
