"""Bad input to the `kvtune` commands a user runs: exit code 2, the field or flag named with its fix, no
traceback, and nothing started (no run folder, no engine log, no engine process).

Each case runs the real command line in a subprocess, as a user meets it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.cli import main as cli_main
from kvtune.commands import up
from kvtune.loadgen.workload_args import MOST_MAX_TOKENS, MOST_RATE, MOST_USERS, MOST_WORKERS
from tests.helpers import DEFAULT_PROFILE, write_test_profile

QUICK_SPEC = DEFAULT_PROFILE.parent.parent / "sweeps" / "cpu-quick.yaml"


def kvtune(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtune.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | (env or {}),
        check=False,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    flat = " ".join(output.split())
    for text in expected:
        assert text in flat, f"{text!r} not in: {flat}"


def write_profile(folder: Path, name: str = "p.yaml", **overrides: Any) -> Path:
    return write_test_profile(folder / name, **overrides)


def write_spec(folder: Path, profile: Path | None = None, **changes: Any) -> Path:
    spec = yaml.safe_load(QUICK_SPEC.read_text())
    spec["base_profile"] = str(profile or DEFAULT_PROFILE)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = spec[key] | value
        else:
            spec[key] = value
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Path]:
    folder = tmp_path / "runs"
    yield folder
    # Nothing started: no run folder was made for a refused sweep.
    assert not folder.exists() or not any(folder.iterdir()), list(folder.iterdir())


# ---- documents --------------------------------------------------------------------------------------


def test_profile_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"name: caf\xe9\nmodel: smollm2-135m\n")
    assert_refused(kvtune("render", str(path)), str(path), "UTF-8")


def test_profile_path_that_is_a_folder(tmp_path: Path) -> None:
    assert_refused(kvtune("render", str(tmp_path)), str(tmp_path))


def test_env_key_that_is_not_a_name(tmp_path: Path) -> None:
    path = write_profile(tmp_path, env={"A=B": "1"})
    assert_refused(kvtune("render", str(path)), "env: 'A=B' is not an environment variable name")


def test_extra_args_repeating_the_port(tmp_path: Path) -> None:
    path = write_profile(tmp_path, extra_args=["--port", "9"])
    assert_refused(kvtune("render", str(path)), "extra_args[0]: '--port' is vLLM's --port", "'port'")


# ---- kvtune sweep -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"name": "../../x"}, ["name:", "cannot be a name: use 1 to 63 letters"]),
        ({"load": {"start_rate": 2.0, "max_rate": 1.0}}, ["load:", "max_rate 1 is below start_rate 2"]),
        ({"workload": {"args": {"system-tokens": "abc"}}}, ["workload.args", "system-tokens"]),
        ({"workload": {"args": {"sytem-tokens": 600}}}, ["workload.args", "sytem-tokens", "system-tokens"]),
        ({"workload": {"args": {"user-tokens": -5}}}, ["workload.args", "user-tokens"]),
        ({"workload": {"args": {"doc-tokens": 10**9}, "name": "long_doc_qa"}}, ["outside 1..1,048,576"]),
        (
            {"workload": {"users": 10**6}},
            ["workload.users: 1000000 is not valid", "less than or equal to 10000"],
        ),
        ({"workload": {"max_tokens": 10**7}}, ["workload.max_tokens: 10000000 is not valid"]),
        ({"slo": {"confidence": 0.5}}, ["slo.confidence: 0.5 is not valid", "greater than 0.5"]),
        ({"slo": {"confidence": 1.0}}, ["slo.confidence: 1.0 is not valid", "less than 1"]),
        (
            {"load": {"step_seconds": 20, "max_step_seconds": 10}},
            ["load:", "max_step_seconds 10 is below step_seconds 20", "raise max_step_seconds"],
        ),
        (
            {"slo": {"itl_p99_s": 0.5}, "workload": {"max_tokens": 1}},
            ["slo.itl_p99_s: workload.max_tokens is 1", "no inter-token gap to measure"],
        ),
    ],
)
def test_bad_sweep_spec(tmp_path: Path, runs: Path, changes: dict[str, Any], expected: list[str]) -> None:
    spec = write_spec(tmp_path, **changes)
    assert_refused(kvtune("sweep", str(spec), "--dry-run"), *expected)
    assert_refused(kvtune("sweep", str(spec), "--runs-dir", str(runs)), *expected)


def test_sweep_of_a_profile_bound_beyond_loopback(tmp_path: Path, runs: Path) -> None:
    spec = write_spec(tmp_path, write_profile(tmp_path, host="0.0.0.0"))  # noqa: S104 - the case refused
    assert_refused(
        kvtune("sweep", str(spec), "--runs-dir", str(runs)),
        "base_profile: binds host 0.0.0.0",
        "expose_dev_endpoints: true",
    )


def test_runs_dir_that_is_a_file_or_cannot_be_written(tmp_path: Path) -> None:
    spec = write_spec(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_refused(kvtune("sweep", str(spec), "--runs-dir", str(blocker)), "--runs-dir", "is not a folder")
    assert_refused(
        kvtune("sweep", str(spec), "--runs-dir", str(blocker / "runs")), "--runs-dir", "cannot write there"
    )


def test_sweep_without_its_api_key(tmp_path: Path, runs: Path) -> None:
    spec = write_spec(tmp_path, write_profile(tmp_path, api_key_env="KVTUNE_ABSENT_KEY"))
    assert_refused(
        kvtune("sweep", str(spec), "--runs-dir", str(runs)),
        "api_key_env: the environment variable KVTUNE_ABSENT_KEY is not set",
    )


def test_resume_of_a_folder_that_is_not_a_run(tmp_path: Path) -> None:
    assert_refused(kvtune("sweep", "--resume", str(tmp_path)), "is not a sweep run folder")


# ---- kvtune load --------------------------------------------------------------------------------------

# Its bounded number flags and the ranges --help states: each refused past either end by argparse (exit 2,
# before the URL is even asked), naming the flag and the range.
LOAD_COUNTS = {
    "--users": (1, MOST_USERS),
    "--workers": (0, MOST_WORKERS),
    "--max-tokens": (1, MOST_MAX_TOKENS),
}


def _whole_in(text: str, least: int, most: int) -> bool:
    try:
        return least <= int(text) <= most
    except ValueError:
        return False


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flag=st.sampled_from(sorted(LOAD_COUNTS)),
    value=st.one_of(
        st.integers(min_value=-(10**12), max_value=10**12).map(str),
        st.sampled_from(["inf", "nan", "1e9", "2.5", "", "0x10", "\uff11\uff10"]),
    ),
)
def test_load_with_a_count_out_of_range(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    least, most = LOAD_COUNTS[flag]
    if _whole_in(value, least, most):
        return  # within range: nothing to refuse
    with pytest.raises(SystemExit) as exited:
        cli_main(["load", "--url", "http://127.0.0.1:9", flag, value])
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"argument {flag}: " in err and "Traceback" not in err
    assert f"give {least:,} to {most:,}" in err or "is not a whole number" in err, err


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", f"{MOST_RATE * 2:g}", "fast"])
def test_load_with_a_rate_out_of_range(capsys: pytest.CaptureFixture[str], value: str) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["load", "--url", "http://127.0.0.1:9", "--rate", value])
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "argument --rate: " in err and f"give one above 0 req/s and at most {MOST_RATE:,g} req/s" in err


def test_load_help_states_every_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["load", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, (least, most) in LOAD_COUNTS.items():
        assert f"{least:,} to {most:,}" in text.split(flag, 2)[-1][:300], flag
    assert (
        f"at most {MOST_RATE:,g}" in text and "system-tokens tokens of the shared system prompt (1 to" in text
    )


# ---- kvtune up and ask --------------------------------------------------------------------------------


def test_up_with_a_log_dir_that_cannot_be_written(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = kvtune("up", str(write_profile(tmp_path)), "--log-dir", str(blocker / "logs"))
    assert_refused(result, "--log-dir", "cannot write there")


def test_up_without_a_secret_it_names(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    path = write_profile(tmp_path, secret_env=["KVTUNE_ABSENT_SECRET"])
    assert_refused(
        kvtune("up", str(path), "--log-dir", str(logs)), "secret_env: KVTUNE_ABSENT_SECRET not set"
    )
    assert not logs.exists() or not any(logs.iterdir())


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--control-port", "99999"], "--control-port: 99999 is not a port number; give 1-65535"),
        (["--router-port", "0"], "--router-port: 0 is not a port number"),
        (["--ready-timeout", "inf"], "--ready-timeout: inf is not a usable number of seconds"),
        (["--stop-grace", "nan"], "--stop-grace: nan is not a usable number of seconds"),
        (["--scrape-interval", "-1"], "--scrape-interval: -1 is not a usable number of seconds"),
        (["--max-restarts", "-2"], "--max-restarts: -2 is below 0"),
        (["--router-load-factor", "inf"], "--router-load-factor: inf is out of range; give one above 1"),
        (["--router-workers", "100000"], "--router-workers: 100000 is out of range; give 1 to 64"),
        (["--router-max-body-mib", "1e-9"], "--router-max-body-mib: 1e-9 is out of range; give 0.001 to"),
        (["--router-max-body-mib", "0.000001"], "--router-max-body-mib: 0.000001 is out of range"),
        (["--capture-max-mib", "inf"], "--capture-max-mib: inf is out of range; give 0.01 to 16,384 MiB"),
        (["--capture-keep", "99999"], "--capture-keep: 99999 is out of range; give 1 to 10,000"),
    ],
)
def test_up_with_a_number_flag_out_of_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    # In-process: argparse refuses before anything runs, and a subprocess per flag would cost seconds each.
    logs = tmp_path / "logs"
    with pytest.raises(SystemExit) as exited:
        cli_main(["up", str(write_profile(tmp_path)), "--log-dir", str(logs), *flags])
    assert exited.value.code == 2
    assert expected in " ".join(capsys.readouterr().err.split())
    assert not logs.exists()


def test_up_with_two_users_of_one_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # In-process, with the model's preparation failing the test: a plan that missed it starts no engine.
    monkeypatch.setattr(up, "resolve_model", lambda *_args: pytest.fail("planning let the run start"))
    logs = tmp_path / "logs"
    path = write_profile(tmp_path, port=18123, kv_events_port=18124, kv_events_replay_port=18124)
    assert cli_main(["up", str(path), "--log-dir", str(logs)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "port 18124 is both the KV events of engine" in err and "and the KV-event replay of engine" in err
    assert not logs.exists()


def test_up_on_a_network_address_without_an_api_key(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = kvtune("up", str(write_profile(tmp_path)), "--log-dir", str(logs), "--control-host", "0.0.0.0")  # noqa: S104
    assert_refused(result, "--control-host 0.0.0.0: the control API would show", "set api_key_env")
    assert not logs.exists()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"port": 65535, "replicas": 2}, "replicas 2 from port 65535 would need ports past 65535"),
        ({"kv_events_port": 65500, "replicas": 64}, "lower kv_events_port to 65472 or less"),
        ({"model": "org/model\nport: 1"}, "model must be one line of text"),
        ({"name": "../../x"}, "name: '../../x' cannot be a name"),
    ],
)
def test_render_refuses_a_profile_that_would_break_what_it_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fields: dict[str, Any], expected: str
) -> None:
    data = yaml.safe_load(write_profile(tmp_path).read_text()) | fields
    path = tmp_path / "odd.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli_main(["render", str(path)]) == 2
    assert expected in " ".join(capsys.readouterr().err.split())


def test_up_refuses_kv_events_off_loopback_unless_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = [
        write_test_profile(
            tmp_path / f"p{i}.yaml", name=f"e{i}", host="10.1.2.3", port=8100 + i, kv_events_port=5600 + i
        )
        for i in range(2)
    ]
    logs = tmp_path / "logs"
    assert cli_main(["up", *map(str, paths), "--log-dir", str(logs)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "where anyone who reaches that port can feed it events" in err
    assert "--router-kv-events-off-loopback" in err
    assert not logs.exists()


def test_ask_with_its_port_taken(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = write_profile(tmp_path, port=port)
        result = kvtune("ask", str(path), "--log-dir", str(tmp_path / "logs"))
    assert_refused(result, f"port {port} on 127.0.0.1 is already in use", "profile field 'port'")
    assert not (tmp_path / "logs").exists()


def test_model_prepare_with_a_cache_dir_that_is_a_file(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = kvtune("model", "prepare", "smollm2-135m", "--cache-dir", str(blocker))
    assert_refused(result, "model cache (--cache-dir or KVTUNE_CACHE_DIR)", "cannot write there")


# ---- kvtune doctor ----------------------------------------------------------------------------------

DOCTOR_PLANT = "pw-doctor-7c1e"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["http://127.0.0.1:9", "--prometheus", "--selector", "job=vllm}"], ["--selector"]),
        (["http://127.0.0.1:9", "--selector", 'job="a"'], ["--selector", "give it with --prometheus"]),
        (["javascript:alert(1)", "--prometheus"], ["expected a base URL", "http:// or https://"]),
        (["http://127.0.0.1:9/?q=1"], ["drop the ?query"]),
        (["http://127.0.0.1:9", "--timeout", "0"], ["--timeout", "above 0 and at most 600"]),
        (
            [f"http://u:{DOCTOR_PLANT}@127.0.0.1:9", "--api-key-env", "HOME"],
            ["http://u:***@127.0.0.1:9", "a request carries one Authorization header"],
        ),
    ],
)
def test_doctor_with_bad_input(argv: list[str], expected: list[str]) -> None:
    result = kvtune("doctor", *argv)
    assert_refused(result, *expected)
    assert DOCTOR_PLANT not in result.stdout + result.stderr


# ---- kvtune plan ------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    flag=st.sampled_from(["--peak-rate", "--min-rate"]),
    value=st.one_of(
        st.floats(max_value=0.0).map(repr),
        st.sampled_from(["nan", "inf", "-inf", "1e-400", "1e999", "", "fast", "0x10"]),
    ),
)
def test_plan_with_a_rate_not_above_0(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    # FLAG=VALUE: argparse reads "-inf" after a flag as another flag.
    with pytest.raises(SystemExit) as exited:
        cli_main(["plan", "no-run", "--peak-rate=40", f"{flag}={value}"])
    assert exited.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"argument {flag}: " in err and "Traceback" not in err
    assert "is not a finite number above 0" in err or "is not a number" in err, err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--peak-rate", "40"], ["RUN_DIR", "is not a folder; pass the run folder a sweep printed"]),
        (["--peak-rate", "4", "--min-rate", "5"], ["--min-rate 5 is above --peak-rate 4"]),
        (["--peak-rate", "4", "--gpus-per-node", "0"], ["--gpus-per-node", "give 1 or more"]),
    ],
)
def test_plan_with_bad_input(tmp_path: Path, argv: list[str], expected: list[str]) -> None:
    assert_refused(kvtune("plan", str(tmp_path / "no-run"), *argv), *expected)
