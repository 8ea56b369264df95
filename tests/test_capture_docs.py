"""`make docs-capture` (tools/capture_docs.py), without engines: what a capture keeps of an output (paths,
ports and process ids as stable placeholders, no credential), that every command it shows is one kvtune
parses, that the guides include only captures it writes and it writes none they do not include, and that the
processes it starts are stopped, whether a command fails or a stop is asked for."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtune import processes
from kvtune.cli import build_parser
from kvtune.stop_request import StopRequest
from tests.helpers import REPO
from tools import capture_docs
from tools.capture_docs import (
    CaptureFailed,
    Interrupted,
    Run,
    Scenario,
    Session,
    Shown,
    Write,
    capture_text,
    normalise,
    path_replacements,
    run_scenario,
    with_real_ports,
)

DOCS = REPO / "docs"
INCLUDE = re.compile(r'^[ \t]*--8<--[ \t]+"captured/(?P<name>[^"]+)\.txt"[ \t]*$', re.MULTILINE)
FAKE_SECRET = "hf_" + "Zq8" * 10  # a Hugging Face token's form, made up

SHOWN_PORTS = st.sampled_from([capture_docs.ENGINE_PORT, capture_docs.CONTROL_PORT])
FREE_PORTS = st.integers(min_value=10_000, max_value=65_535)


def shown_commands() -> list[str]:
    return [command for scenario in capture_docs.SCENARIOS for command in scenario.commands()]


def included_captures() -> dict[str, list[str]]:
    """Each capture a page includes, with the pages that include it."""
    found: dict[str, list[str]] = {}
    for page in sorted(DOCS.rglob("*.md")):
        for match in INCLUDE.finditer(page.read_text(encoding="utf-8")):
            found.setdefault(match["name"], []).append(str(page.relative_to(REPO)))
    return found


# ---- what a capture keeps --------------------------------------------------------------------------------


def test_paths_become_the_folder_the_guide_runs_in_the_repo_and_home(tmp_path: Path) -> None:
    folder = tmp_path / "kvtune-docs-x"
    raw = (
        f"wrote {folder}/curve/curve.json\nrun folder {folder}\n{REPO}/.venv/bin/python -m vllm\n"
        f"{Path.home()}/.cache/kvtune/models/smollm2-135m\n"
    )
    assert normalise(raw, path_replacements(folder), {}) == (
        "wrote curve/curve.json\nrun folder .\n.venv/bin/python -m vllm\n"
        "~/.cache/kvtune/models/smollm2-135m\n"
    )


@given(shown=SHOWN_PORTS, real=FREE_PORTS)
def test_a_real_port_is_shown_as_the_guides_and_only_as_a_whole_number(shown: int, real: int) -> None:
    others = f"{real}0 tokens, 1{real} and {real}.5\n"  # numbers that merely contain the port
    raw = f"http://127.0.0.1:{real}/v1 port {real}, --control-port {real}\n{others}"
    shown_text = f"http://127.0.0.1:{shown}/v1 port {shown}, --control-port {shown}\n{others}"
    assert normalise(raw, [], {shown: real}) == shown_text


@given(shown=SHOWN_PORTS, real=FREE_PORTS)
def test_a_command_runs_on_the_real_port_and_is_shown_on_the_guides(shown: int, real: int) -> None:
    command = f"kvtune doctor http://127.0.0.1:{shown} --window 40"
    running = with_real_ports(command, {shown: real})
    assert running == f"kvtune doctor http://127.0.0.1:{real} --window 40"
    assert normalise(running, [], {shown: real}) == command + "\n"


def test_process_ids_terminal_codes_and_trailing_space_are_dropped() -> None:
    raw = "\x1b[1mengine small-pool: started pid 41234\x1b[0m   \nprocess group 5150 ended\r\n\n\n"
    assert normalise(raw, [], {}) == "engine small-pool: started pid PID\nprocess group PID ended\n"


def test_a_capture_shows_each_command_after_a_prompt_and_a_file_under_its_name() -> None:
    text = capture_text([Shown(None, "# a.yaml\nname: a\n"), Shown("kvtune render a.yaml", "out\n")])
    assert text == "# a.yaml\nname: a\n$ kvtune render a.yaml\nout\n"


# ---- what the script shows -------------------------------------------------------------------------------


def test_every_kvtune_command_shown_parses() -> None:
    commands = [command for command in shown_commands() if command.startswith("kvtune ")]
    assert len(commands) >= 10, commands
    for command in commands:
        argv = command.split()[1:]
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as exc:  # argparse's way of refusing
            raise AssertionError(f"`{command}` does not parse") from exc


def test_scenario_and_capture_names_are_unique_and_listed() -> None:
    names = [scenario.name for scenario in capture_docs.SCENARIOS]
    assert len(names) == len(set(names))
    owners: dict[str, str] = {}
    for scenario in capture_docs.SCENARIOS:
        for capture in scenario.captures():
            assert capture not in owners, f"{capture} is written by {owners[capture]} and {scenario.name}"
            owners[capture] = scenario.name
    listing = capture_docs.listing(capture_docs.SCENARIOS)
    for scenario in capture_docs.SCENARIOS:
        assert f"{scenario.name}{' (starts a vLLM engine)' if scenario.engine else ''}:" in listing
    assert all(command in listing for command in shown_commands())


def test_the_guides_include_only_captures_the_script_writes_and_every_one_it_writes() -> None:
    written = {capture for scenario in capture_docs.SCENARIOS for capture in scenario.captures()}
    included = included_captures()
    unknown = {name: pages for name, pages in included.items() if name not in written}
    assert not unknown, f"pages include captures no scenario writes: {unknown}"
    assert not written - included.keys(), (
        f"captured but shown on no page: {sorted(written - included.keys())}"
    )


def test_the_committed_captures_are_the_ones_the_script_writes() -> None:
    written = {capture for scenario in capture_docs.SCENARIOS for capture in scenario.captures()}
    committed = {path.stem for path in (DOCS / "captured").glob("*.txt")}
    assert committed == written, (
        f"run `make docs-capture`: missing {sorted(written - committed)}, stale {sorted(committed - written)}"
    )


# ---- running, failing and stopping ----------------------------------------------------------------------


def session(tmp_path: Path, stop: StopRequest | None = None) -> Session:
    return Session("test", tmp_path, stop or StopRequest(), {})


def test_a_command_that_exits_otherwise_fails_its_capture_naming_it(tmp_path: Path) -> None:
    shell = session(tmp_path)
    try:
        with pytest.raises(CaptureFailed, match=r"`false` exited 1, not 0"):
            shell.run(Run("false", show="x"))
        shell.run(Run("false", show="x", expect=(1,)))  # a refusal the guide shows on purpose
        assert shell.captured["x"] == [Shown("false", "")]
    finally:
        shell.close()


def test_a_background_command_is_stopped_with_its_group_when_the_session_closes(tmp_path: Path) -> None:
    shell = session(tmp_path)
    shell.run(Run("sleep 60", show=None, background="sleeper"))
    pid = shell.running["sleeper"].proc.pid
    assert processes.group_members(pid)
    shell.close()
    assert not processes.group_members(pid)
    assert not shell.running


def test_a_stop_asked_for_ends_the_wait_and_leaves_nothing_running(tmp_path: Path) -> None:
    stop = StopRequest()
    shell = session(tmp_path, stop)
    shell.run(Run("sleep 60", show=None, background="sleeper"))
    pid = shell.running["sleeper"].proc.pid
    stop.set(signal.SIGINT)
    began = time.monotonic()
    with pytest.raises(Interrupted, match="Ctrl-C"):
        shell.wait(capture_docs.Wait("sleeper"))
    shell.close()
    assert time.monotonic() - began < 15
    assert not processes.group_members(pid)


def test_a_capture_holding_a_credential_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(capture_docs, "REPO", tmp_path)
    (tmp_path / "deploy").mkdir()
    leaky = Scenario(
        "leaky", (Write("notes.txt", f"token {FAKE_SECRET}\n"), Run("cat notes.txt", show="leaky"))
    )
    with pytest.raises(CaptureFailed, match=r"leaky: lines \[2\] hold a value in a credential's form"):
        run_scenario(leaky, StopRequest())


def test_commands_run_without_the_credentials_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", FAKE_SECRET)
    monkeypatch.setenv("KVTUNE_API_KEY", "made-up-key")
    env = capture_docs.command_env()
    assert "HF_TOKEN" not in env and "KVTUNE_API_KEY" not in env
    assert FAKE_SECRET not in env.values()
    assert env["COLUMNS"] == capture_docs.COLUMNS
