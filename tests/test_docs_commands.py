"""Every command the manual shows is one kvtune accepts: each `kvtune ...` line of a fenced code block in
README.md and docs/**/*.md, and each command line of docs/captured/*.txt, parses with kvtune's own parser;
each `make TARGET` they name is a target of the Makefile; the README stays a front door (at most 150 lines,
opening with `make demo` and `make test`).

The commands are found, not listed: a page that gains a command is checked with no edit here, and a failure
names the file and line of the command. Placeholders (RUN_DIR, SPEC, $URL) pass as values; a pipe, `&&`, `;`
or a redirection ends the command.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtune.cli import build_parser
from tests.helpers import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MAKEFILE = REPO / "Makefile"
README_MOST_LINES = 150
# Fewer would mean the search found little: the manual shows well over this many kvtune commands.
FEWEST_KVTUNE_COMMANDS = 40
FEWEST_MAKE_TARGETS = 4

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*\{?[ \t]*\.?(?P<language>[\w+-]*)")
# Fenced blocks of data or code in another language: a line there is never a shell command.
NOT_SHELL = {"yaml", "yml", "json", "python", "py", "promql", "toml", "ini", "jinja", "html", "css", "js"}
PROMPT = re.compile(r"^\$[ \t]+")
# A shell command line that runs kvtune or make, after any `NAME=value` assignments before it.
COMMAND = re.compile(r"^(?:[A-Za-z_]\w*=\S*\s+)*(?P<program>kvtune|make)(?:\s|$)")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
# A file descriptor before a redirection (`2>&1`): dropped, or it would read as an argument.
DESCRIPTOR = re.compile(r"(?<=\s)\d+(?=[<>])")
INLINE_MAKE = re.compile(r"`make(?P<args>(?: [^`]+)?)`")
TARGET = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
RULE = re.compile(r"^(?P<targets>[A-Za-z0-9_.][^:=#$]*?)[ \t]*::?(?!=)")


@dataclass(frozen=True)
class Command:
    """One command line the manual shows: where it is and its words (the program first)."""

    path: Path
    line: int
    words: tuple[str, ...]

    def where(self) -> str:
        path = self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path
        return f"{path}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where()}: {shlex.join(self.words)}"


def documents() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def captured() -> list[Path]:
    return sorted((DOCS / "captured").glob("*.txt"))


def fenced_blocks(text: str) -> Iterator[tuple[str, list[tuple[int, str]]]]:
    """Each fenced code block: its language and its logical lines (backslash continuations joined), each with
    the number of its first line; the fence's own indentation (a block inside an admonition) is removed."""
    fence: re.Match[str] | None = None
    block: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if fence is None:
            fence, block, pending = FENCE.match(line), [], None
            continue
        closing = line.strip()
        if closing.startswith(fence["fence"]) and set(closing) == {fence["fence"][0]}:
            yield fence["language"].lower(), block
            fence = None
            continue
        indent = fence["indent"]
        code = line[len(indent) :] if line.startswith(indent) else line.lstrip()
        start, joined = pending if pending else (number, "")
        joined += code
        if joined.endswith("\\"):
            pending = (start, joined[:-1] + " ")
            continue
        pending = None
        block.append((start, joined))


def fenced_lines(text: str) -> Iterator[tuple[int, str]]:
    """Each logical line of the fenced blocks that may hold shell commands."""
    for language, block in fenced_blocks(text):
        if language not in NOT_SHELL:
            yield from block


def command_words(line: str) -> tuple[str, ...] | None:
    """The words of a kvtune or make command line (its prompt, leading assignments and comment dropped, cut at
    the first pipe, `&&`, `;`, `&` or redirection), or None when the line runs neither."""
    line = PROMPT.sub("", line.strip())
    if not COMMAND.match(line):
        return None
    lexer = shlex.shlex(DESCRIPTOR.sub("", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words: list[str] = []
    for word in lexer:
        if word and set(word) <= set("|&;<>()"):
            break
        if words or not ASSIGNMENT.match(word):
            words.append(word)
    return tuple(words)


def commands_in(path: Path) -> list[Command]:
    """The command lines of a Markdown page's fenced blocks, or of a captured output's prompt lines."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        lines: Iterable[tuple[int, str]] = (
            (number, line) for number, line in enumerate(text.splitlines(), start=1) if PROMPT.match(line)
        )
    else:
        lines = fenced_lines(text)
    found = []
    for number, line in lines:
        try:
            words = command_words(line)
        except ValueError as exc:  # an unclosed quote: the shell would not run it either
            raise AssertionError(f"{path}:{number}: {exc}: {line}") from exc
        if words:
            found.append(Command(path, number, words))
    return found


def inline_make_targets(path: Path) -> list[Command]:
    """`make TARGET` in a page's inline code (prose naming a target)."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for match in INLINE_MAKE.finditer(line):
            found.append(Command(path, number, ("make", *match["args"].split())))
    return found


def all_commands() -> list[Command]:
    return [command for path in [*documents(), *captured()] for command in commands_in(path)]


def parse_problem(words: tuple[str, ...]) -> str | None:
    """What kvtune's parser says against a `kvtune ...` command, or None when it parses."""
    argv = list(words[1:])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as exit_:
            if exit_.code not in (0, None):  # --help and --version exit 0
                return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else str(exit_)
    return None


def makefile_targets(makefile: Path = MAKEFILE) -> set[str]:
    targets: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        if match := RULE.match(line):
            targets.update(match["targets"].split())
    return targets


def make_targets(command: Command) -> list[str]:
    """The targets a make command names: its options, VAR=value settings and placeholders (`...`, TARGET)
    left out."""
    return [word for word in command.words[1:] if TARGET.match(word) and not PLACEHOLDER.match(word)]


def test_every_kvtune_command_in_the_manual_parses() -> None:
    commands = [command for command in all_commands() if command.words[0] == "kvtune"]
    assert len(commands) >= FEWEST_KVTUNE_COMMANDS, (
        f"only {len(commands)} kvtune commands found in README.md, docs/ and docs/captured/:\n"
        + "\n".join(map(str, commands))
    )
    problems = [
        f"{command}\n    {problem}" for command in commands if (problem := parse_problem(command.words))
    ]
    assert not problems, f"{len(problems)} of {len(commands)} commands do not parse:\n" + "\n".join(problems)


def test_every_make_target_the_manual_names_exists() -> None:
    targets = makefile_targets()
    named = [command for command in all_commands() if command.words[0] == "make"]
    named += [command for path in documents() for command in inline_make_targets(path)]
    assert len({target for command in named for target in make_targets(command)}) >= FEWEST_MAKE_TARGETS, (
        named
    )
    unknown = [
        f"{command.where()}: make {target}"
        for command in named
        for target in make_targets(command)
        if target not in targets
    ]
    assert not unknown, "targets the Makefile does not have:\n" + "\n".join(unknown)


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MOST_LINES, f"README.md has {len(lines)} lines; at most {README_MOST_LINES}"
    _language, first_block = next(fenced_blocks("\n".join(lines)), ("", []))
    opening = [command_words(line) for _, line in first_block]
    assert ("make", "demo") in opening and ("make", "test") in opening, first_block


# The checks above are only as good as what they find: each finder is shown lines it must find and cut.
PAGE = """\
Some prose with `make docs`, `make PYTHON=python3.12 ...` and `make TARGET` inline.

```bash
kvtune sweep SPEC --dry-run   # a comment
PGPASSWORD=... kvtune sweep --collect NAME --storage postgresql://kvtune@db/sweeps
$ kvtune load --url "$URL" --users 4 | tee load.txt
kvtune doctor http://127.0.0.1:8000 --window 60 2>&1 > out.txt
kvtune up fleet.yaml \\
  --router-workers 2 &
helm install x helm/kvtune
make demo test
```

!!! note
    ```
    kvtune plan RUN_DIR --peak-rate nope
    ```

```yaml
kvtune render: not a command
```
"""


def test_the_finders_find_what_a_page_shows(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = [(command.line, command.words) for command in commands_in(page)]
    assert found == [
        (4, ("kvtune", "sweep", "SPEC", "--dry-run")),
        (5, ("kvtune", "sweep", "--collect", "NAME", "--storage", "postgresql://kvtune@db/sweeps")),
        (6, ("kvtune", "load", "--url", "$URL", "--users", "4")),
        (7, ("kvtune", "doctor", "http://127.0.0.1:8000", "--window", "60")),
        (8, ("kvtune", "up", "fleet.yaml", "--router-workers", "2")),
        (11, ("make", "demo", "test")),
        (16, ("kvtune", "plan", "RUN_DIR", "--peak-rate", "nope")),
    ]
    inline = inline_make_targets(page)
    assert [make_targets(command) for command in inline] == [["docs"], [], []], inline
    kvtune = [command for command in commands_in(page) if command.words[0] == "kvtune"]
    verdicts = {command.line: parse_problem(command.words) for command in kvtune}
    assert [line for line, problem in verdicts.items() if problem] == [16], verdicts
    assert "--peak-rate" in (verdicts[16] or ""), verdicts[16]


def test_the_makefile_reader_finds_its_targets() -> None:
    targets = makefile_targets()
    assert {"demo", "test", "lint", "generate", "docs", "docs-capture", "sysdeps", "bench-fleet"} <= targets
    assert not {"BIN", "SUDO", "PYTHON", "$(STAMP)"} & targets
