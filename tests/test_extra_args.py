"""extra_args judged as vLLM's own argument parser reads them: every spelling vLLM accepts of a flag kvtune
owns or of a flag carrying a credential is refused, by the profile and by the chart's schema.

The judge reads vLLM's committed flag table (kvtune/vllm_flags.json) and never imports vLLM; these tests do:
the table is regenerated from the installed vLLM and compared, and the spellings are generated from it (each
option's abbreviations, `=value`, `_` for `-`, `.key`, and the `--no-` options vLLM registers, by hand and by
hypothesis) and checked against vLLM's own full parse, so a flag a new vLLM adds is covered without a list
kept by hand. Importing vLLM takes a few seconds, once.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune import vllm_flags, vllm_parser
from kvtune.helm.build import refused_flag_table
from kvtune.profile import (
    MANAGED_FLAGS,
    RESERVED_SETTINGS,
    EngineProfile,
    extra_args_problem,
    refused_settings,
    setting_problem,
)
from kvtune.vllm_parser import Setting, VllmParser
from tests.helpers import default_profile_data

VALUE = "1"


class _Refused(Exception):
    pass


class FullParse:
    """vLLM's api_server parser as vLLM itself runs it (FlexibleArgumentParser.parse_args on the words),
    noting each setting argparse takes a value for, in order; errors raised instead of exiting."""

    def __init__(self) -> None:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        taken: list[str] = []

        class Noting(FlexibleArgumentParser):
            def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
                taken.append("help" if action.dest == argparse.SUPPRESS else action.dest)
                return super()._get_values(action, arg_strings)

            def error(self, message: str) -> Any:
                raise _Refused(message)

            def exit(self, status: int = 0, message: str | None = None) -> Any:
                raise _Refused(message or "exit")

            def print_help(self, file: Any = None) -> None:
                pass

        self._parser = make_arg_parser(Noting())  # type: ignore[no-untyped-call]
        self._taken = taken

    def first_setting(self, words: list[str]) -> str | None:
        """The setting vLLM takes the first word as, or None when it takes it as none (an error first)."""
        self._taken.clear()
        # A bad value after the flag was taken (or a --config file missing) does not undo the taking.
        with contextlib.suppress(_Refused, ValueError):
            self._parser.parse_args(words)
        return self._taken[0] if self._taken else None


@pytest.fixture(scope="module")
def vllm() -> VllmParser:
    return vllm_parser.parser()


@pytest.fixture(scope="module")
def full_parse() -> FullParse:
    return FullParse()


@pytest.fixture(scope="module")
def refused() -> list[Setting]:
    return refused_settings()


@pytest.fixture(scope="module")
def schema_pattern() -> re.Pattern[str]:
    """Every word the chart refuses in engine.extraArgs: its checks match each against each refused flag's
    expression (templates/checks.yaml, the table in templates/_generated.tpl)."""
    return re.compile("|".join(row["pattern"] for row in refused_flag_table()))


def spellings(option_string: str) -> Iterator[str]:
    """Words that might spell OPTION_STRING: its abbreviations (down to one letter after the dashes), with
    `_` for `-`, with `=value` and with `.key` (vLLM's JSON sub-keys)."""
    dashes = 2 if option_string.startswith("--") else 1
    for length in range(dashes + 1, len(option_string) + 1):
        prefix = option_string[:length]
        underscored = prefix[:dashes] + prefix[dashes:].replace("-", "_")
        for word in dict.fromkeys([prefix, underscored]):
            yield from (word, f"{word}={VALUE}", f"{word}.key")
    if dashes == 1:
        yield option_string + VALUE  # a short option's value attached


def refusal(args: list[str]) -> str:
    problem = extra_args_problem(args)
    assert problem is not None, f"{args} accepted"
    with pytest.raises(ValueError, match=re.escape(problem)):
        EngineProfile.model_validate(default_profile_data(extra_args=args))
    return problem


# ---- which settings are refused -------------------------------------------------------------------------


def test_every_flag_the_profile_renders_is_a_vllm_setting_of_that_name(vllm: VllmParser) -> None:
    by_option = {option: setting for setting in vllm.settings() for option in setting.option_strings}
    for flag in MANAGED_FLAGS:
        assert by_option[f"--{flag}"].dest == flag.replace("-", "_"), flag
    for dest in RESERVED_SETTINGS:
        assert any(setting.dest == dest for setting in vllm.settings()), f"vLLM has no setting {dest} now"


def test_owned_credential_and_reserved_settings_are_refused_and_others_are_not(
    refused: list[Setting],
) -> None:
    dests = {setting.dest for setting in refused}
    owned = {flag.replace("-", "_") for flag in MANAGED_FLAGS}
    assert owned | {"api_key", "hf_token", "config", "help", "uds"} <= dests
    # Settings whose names hold a credential word but carry none: a switch, a threshold, a path.
    assert not {"seed", "allow_credentials", "long_prefill_token_threshold", "ssl_ca_certs"} & dests


@pytest.mark.parametrize("dest", ["api_key", "hf_token"])
def test_a_credential_setting_is_refused_as_a_credential(vllm: VllmParser, dest: str) -> None:
    (setting,) = [setting for setting in vllm.settings() if setting.dest == dest]
    problem = setting_problem(setting)
    assert problem is not None and "carries a credential" in problem


# ---- every spelling of a refused setting, refused -------------------------------------------------------


def refused_spellings(setting: Setting, full_parse: FullParse) -> list[str]:
    """The generated spellings vLLM's full parse takes as SETTING."""
    return [
        word
        for option_string in setting.option_strings
        for word in spellings(option_string)
        if full_parse.first_setting([word, VALUE]) == setting.dest
    ]


def test_each_refused_setting_is_tried_in_many_spellings(
    refused: list[Setting], full_parse: FullParse
) -> None:
    (port,) = [setting for setting in refused if setting.dest == "port"]
    words = refused_spellings(port, full_parse)
    # --por and --port, each as is, with =1 and .key: vLLM takes all six as --port.
    assert {"--por", "--port", "--por=1", "--port=1", "--por.key", "--port.key"} <= set(words)


def test_every_spelling_vllm_takes_as_a_refused_setting_is_refused(
    refused: list[Setting], full_parse: FullParse, schema_pattern: re.Pattern[str]
) -> None:
    tried = 0
    missed: list[str] = []
    for setting in refused:
        expected = setting_problem(setting)
        assert expected is not None
        for word in refused_spellings(setting, full_parse):
            tried += 1
            problem = extra_args_problem([word, VALUE])
            if problem is None or f"is vLLM's {setting.name}, which {expected}" not in problem:
                missed.append(f"{word}: {problem}")
            if not schema_pattern.search(word):
                missed.append(f"{word}: the chart lets it through")
    assert not missed, missed
    assert tried > 20 * len(refused)


def test_config_is_refused_before_its_file_is_read(tmp_path: Path) -> None:
    # `--config FILE` spelt out is read by FlexibleArgumentParser itself, before argparse sees a flag.
    problem = refusal(["--config", str(tmp_path / "missing.yaml")])
    assert "is vLLM's --config, which reads further flags from a file" in problem


def test_the_judge_agrees_with_vllm_s_full_parse_on_every_option(
    vllm: VllmParser, full_parse: FullParse
) -> None:
    """Each option's full name and shortest unambiguous abbreviation, of every setting (not only those
    refused): the word-by-word judge names the setting vLLM's full parse takes."""
    disagreements = []
    for setting in vllm.settings():
        for option_string in setting.option_strings:
            underscored = option_string[:2] + option_string[2:].replace("-", "_")
            for word in {option_string, option_string[:-1], underscored} - {"-"}:
                taken = full_parse.first_setting([word, VALUE])
                if taken is None or word == "--config":
                    continue
                judged = vllm.flags([word, VALUE])
                if not judged or judged[0].setting.dest != taken:
                    disagreements.append((word, taken, judged))
    assert not disagreements, disagreements


# ---- the chart's schema matches the same words ----------------------------------------------------------


def test_the_schema_refuses_exactly_the_words_read_as_refused_settings(
    vllm: VllmParser, refused: list[Setting], schema_pattern: re.Pattern[str]
) -> None:
    """Over every abbreviation of every option (refused or not; `=value` and `.key` follow the same words),
    the schema's pattern matches a word when the judge reads it as a refused setting, and lets through a
    word read as any other."""
    dests = {setting.dest for setting in refused}
    wrong = []
    for setting in vllm.settings():
        for option_string in setting.option_strings:
            for word in spellings(option_string):
                if "=" in word or "." in word:
                    continue
                try:
                    judged = vllm.flags([word])
                except vllm_parser.ExtraArgError:
                    continue  # vLLM refuses the word itself: ambiguous or unknown
                if judged and (judged[0].setting.dest in dests) != bool(schema_pattern.search(word)):
                    wrong.append((word, judged[0].setting.dest))
    assert not wrong, wrong


# ---- what stays allowed, and how refusals read --------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--seed", "1"],
        ["--max-logprobs=5"],
        ["--max_logprobs", "5"],
        ["--disable-log-stats"],
        ["--no-enable-log-requests"],
        ["-O3"],
        ["--compilation-config.mode", "3"],
        ["--seed", "-1"],
        ["--allow-credentials"],
    ],
)
def test_harmless_flags_are_accepted(args: list[str]) -> None:
    assert extra_args_problem(args) is None
    assert EngineProfile.model_validate(default_profile_data(extra_args=args)).extra_args == args


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--seed", "1", "--por", "9999"],
            "extra_args[2]: '--por' is vLLM's --port, which the profile sets itself; remove it and set the "
            "profile field 'port' instead",
        ),
        (
            ["--api-ke", "sk-X"],
            "extra_args[0]: '--api-ke' is vLLM's --api-key, which carries a credential, and extra_args are "
            "written to every output; remove it and name the environment variable holding it in the profile "
            "field 'api_key_env' instead",
        ),
        (["--hf_token=abc"], "extra_args[0]: '--hf_token' is vLLM's --hf-token, which carries a credential"),
        (
            ["-tp", "2"],
            "extra_args[0]: '-tp' is vLLM's --tensor-parallel-size, which the profile sets itself",
        ),
        (["--kv_cache_dtype=fp8"], "'--kv_cache_dtype' is vLLM's --kv-cache-dtype, which the profile sets"),
        (["--no-enable-prefix-cach"], "set the profile field 'enable_prefix_caching' instead"),
        (["--kv-events-config.topic", "x"], "set the profile field 'kv_events_port' instead"),
        (["--conf", "x.yaml"], "extra_args[0]: '--conf' is ambiguous to vLLM "),
        (["--api=sk-X"], "it could be --api-server-count, --api-key; write the flag in full"),
        (
            ["--max-model-lenght", "9"],
            "has no flag '--max-model-lenght'; did you mean --max-model-len?",
        ),
        (["--enforce-eager=true"], "set the profile field 'enforce_eager' instead"),
        (
            ["--disable-log-stats=1"],
            "'--disable-log-stats' is vLLM's --disable-log-stats, which takes no value",
        ),
        (["--", "--seed", "1"], "extra_args[0]: '--' ends vLLM's flags"),
        (["--he"], "could be --help, --headless"),
        (["-h"], "'-h' is vLLM's --help, which prints vLLM's help and exits instead of serving; remove it"),
        (["--ud", "/tmp/s"], "'--ud' is vLLM's --uds, which serves on a Unix socket"),
    ],
)
def test_refusals_name_the_word_the_setting_and_the_fix(args: list[str], expected: str) -> None:
    assert expected in refusal(args)


def test_a_credential_is_never_quoted_back() -> None:
    for args in (
        ["--api-key=sk-X-1"],
        ["--api=sk-X-1"],
        ["--hf-token", "sk-X-1"],
        ["--seed=sk-X-1", "--port"],
    ):
        assert "sk-X-1" not in refusal(args), args
    # A value in a published token format is refused wherever it stands, and not shown.
    problem = refusal(["--served-model-name-x", "hf_" + "a" * 30])
    assert problem.startswith("extra_args[1]: looks like a credential (not shown)"), problem


# ---- the flag table, and no vLLM where a profile is judged --------------------------------------------


def test_the_committed_flag_table_is_the_installed_vllm_s() -> None:
    """kvtune/vllm_flags.json is what vLLM's parser gives now (`make generate` writes it)."""
    assert vllm_flags.TABLE_PATH.read_text(encoding="utf-8") == vllm_flags.render(
        vllm_flags.from_installed_vllm()
    ), "vLLM's flags changed: run `make generate` and commit kvtune/vllm_flags.json"


def test_the_table_keeps_what_argparse_knows_of_each_setting() -> None:
    table = vllm_flags.load()
    by_dest = {setting.dest: setting for setting in table.settings}
    assert by_dest["port"].takes_value and by_dest["port"].type == "int"
    assert not by_dest["enforce_eager"].takes_value
    assert "--no-enforce-eager" in by_dest["enforce_eager"].option_strings
    assert by_dest["kv_offloading_backend"].choices == ("lmcache", "native")
    assert by_dest["lora_modules"].nargs == "+"


def test_rendering_and_judging_a_profile_with_extra_args_never_import_vllm(tmp_path: Path) -> None:
    """Importing vLLM took `kvtune render` 14-18 s and 657 MB: the CLI that renders, and the supervisor of
    `kvtune up` that loads the same profile, read the flag table instead."""
    profile = tmp_path / "p.yaml"
    profile.write_text(
        "name: extra\ndevice: cpu\nmodel: smollm2-135m\n"
        "extra_args: ['--seed', '1', '--max_logprobs=5', '--no-enable-log-reque', '-O3']\n",
        encoding="utf-8",
    )
    script = (
        "import sys\n"
        "from kvtune.cli import main\n"
        "import kvtune.commands.up\n"
        "codes = [main(['render', sys.argv[1]]), main(['render', sys.argv[1], '--as', 'helm-values'])]\n"
        "print('vllm:', sorted(name for name in sys.modules if name.split('.')[0] in ('vllm', 'torch')))\n"
        "sys.exit(max(codes))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(profile)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "--max_logprobs=5" in done.stdout and "extraArgs:" in done.stdout, done.stdout
    assert done.stdout.splitlines()[-1] == "vllm: []", done.stdout


# ---- any spelling: the judge against vLLM's full parse -------------------------------------------------

_SUFFIXES = ("", "=1", "=a.b", ".key", ".key+", "=", "+", ".a.b=1")


@st.composite
def mangled_spellings(draw: st.DrawFn) -> str:
    """An option of vLLM's, cut short anywhere, some of its dashes written as underscores, perhaps a dash
    dropped or added in front, and a value, key or `+` after it."""
    option = draw(st.sampled_from(vllm_parser.parser().option_strings()))
    dashes = len(option) - len(option.lstrip("-"))
    cut = draw(st.integers(min_value=dashes + 1, max_value=len(option)))
    body = "".join("_" if char == "-" and draw(st.booleans()) else char for char in option[dashes:cut])
    front = draw(st.sampled_from(["-", "--", "-" * dashes]))
    return front + body + draw(st.sampled_from(_SUFFIXES))


def _judged(vllm: VllmParser, words: list[str]) -> vllm_parser.Flag | None:
    """The flag the judge reads the first of WORDS as, None for a word vLLM refuses (unknown, ambiguous) or
    takes as no flag."""
    try:
        flags = vllm.flags(words)
    except vllm_parser.ExtraArgError:
        return None
    return flags[0] if flags and flags[0].index == 0 else None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(word=mangled_spellings())
def test_any_spelling_resolves_as_vllm_s_full_parse_takes_it(
    vllm: VllmParser, full_parse: FullParse, word: str
) -> None:
    if word == "--config":  # vLLM reads the file it names before parsing anything
        return
    # A word with its value attached stands alone: vLLM moves `--flag.key=1` behind the words after it.
    words = [word] if "=" in word else [word, VALUE]
    taken = full_parse.first_setting(words)
    # An unknown word is set aside and VALUE taken as the model tag, before vLLM refuses the word.
    expected = None if taken == "model_tag" else taken
    judged = _judged(vllm, words)
    if (judged and judged.setting.dest) != expected:
        # vLLM refuses a switch given a value (`-h=1`, `-he`, `--enforce-eager=1`) before taking it; the
        # judge reads the switch, and refuses the value.
        assert expected is None and judged is not None, (word, judged, expected)
        assert not judged.setting.takes_value and judged.inline_value, (word, judged)
        problem = extra_args_problem(words)
        assert problem is not None and "is vLLM's" in problem, (word, problem)
