"""Credentials on real engines: an engine with an API key refuses requests without it, every kvtune client
(warm-up, load, quality gate) sends it, and no secret value reaches a file kvtune writes or an API answer.

One `kvtune up` engine serves the client checks; the generated `vllm-serve.sh` is run with `sh` and its
engine answers; a one-config sweep writes its run folder, which is searched for the secrets.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune import openai_client
from kvtune.processes import stop_group
from kvtune.profile import EngineProfile
from kvtune.sweep.quality import QualityGate, generate, save_generations
from kvtune.sweep.quality_hook import REFERENCE_FILE, quality_for
from kvtune.sweep.spec import SweepSpec
from tests.conftest import ARTIFACTS, DEFAULT_PROFILE, default_profile_data, free_port

pytestmark = pytest.mark.engine

KEY = "kvtune-test-key-5b1f0c"
SECRET = "kvtune-test-secret-9d2e7a"
CREDENTIALS = {"KVTUNE_TEST_API_KEY": KEY, "KVTUNE_TEST_SECRET": SECRET}
SYSTEM_PROMPT = "You answer in one short sentence about European capitals. " * 8


def keyed_profile_data(**overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "name": "keyed",
        "api_key_env": "KVTUNE_TEST_API_KEY",
        "secret_env": ["KVTUNE_TEST_SECRET"],
        "max_model_len": 2048,
        "kv_cache_memory_bytes": "256MiB",
        "warmup": [{"role": "system", "text": SYSTEM_PROMPT}],
    }
    return default_profile_data(**(settings | overrides))


def files_holding(folder: Path, *values: str) -> list[str]:
    """Every file under `folder` whose bytes contain one of `values`."""
    found = []
    for path in folder.rglob("*"):
        if path.is_file() and any(value.encode() in path.read_bytes() for value in values):
            found.append(str(path))
    return found


def wait_for(predicate: Any, proc: subprocess.Popen[bytes], log: Path, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"exited early while waiting for {what}: {log.read_text()[-3000:]}"
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:]}")


def chat(client: httpx.Client, url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Capital of France?"}], "max_tokens": 4}
    return client.post(f"{url}/v1/chat/completions", json=body)


@pytest.fixture(scope="module")
def keyed_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProfile, str, Path]]:
    """`kvtune up` of a profile with an API key, a secret and a warm-up prefix; yields it when ready."""
    folder = tmp_path_factory.mktemp("keyed-up")
    profile_path = folder / "keyed.yaml"
    profile_path.write_text(yaml.safe_dump(keyed_profile_data()))
    control = f"http://127.0.0.1:{free_port()}"
    log = ARTIFACTS / "keyed-up.log"
    ARTIFACTS.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "kvtune.cli", "up", str(profile_path), "--log-dir", str(folder / "logs"),
            "--control-port", control.rsplit(":", 1)[1]]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=os.environ | CREDENTIALS,
        start_new_session=True,
    )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                engines = httpx.get(f"{control}/engines", timeout=5).json()
            except httpx.HTTPError:
                return False
            return bool(engines) and engines[0]["state"] == "ready"

        wait_for(ready, proc, log, 600, "the keyed engine")
        profile = EngineProfile.model_validate(yaml.safe_load(profile_path.read_text()))
        yield profile, control, folder
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        finally:
            stop_group(proc, grace_s=5)


def test_engine_refuses_requests_without_the_key_and_warm_up_sent_it(
    keyed_up: tuple[EngineProfile, str, Path],
) -> None:
    profile, control, _folder = keyed_up
    with httpx.Client(timeout=60) as anonymous, openai_client.client_for("not-the-key") as wrong:
        assert chat(anonymous, profile.url, profile.api_model_name).status_code == 401
        assert chat(wrong, profile.url, profile.api_model_name).status_code == 401
    with openai_client.client_for(KEY) as keyed:
        assert chat(keyed, profile.url, profile.api_model_name).status_code == 200
        status = httpx.get(f"{control}/engines/keyed", timeout=5).json()
        # The warm-up went through the key: the engine cached the system prompt it was sent.
        assert status["warmup_done"] is True and status["last_failure"] is None
        hits = openai_client.stream_chat(
            keyed, profile.url, profile.api_model_name,
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello."}],
            max_tokens=1,
        )  # fmt: skip
        assert hits.cached_tokens is None or hits.cached_tokens > 0


def test_load_and_quality_gate_send_the_key(
    keyed_up: tuple[EngineProfile, str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile, _control, _folder = keyed_up
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)  # the gate reads the key where the sweep would: its environment
    result = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "load", "--url", profile.url, "--api-key-env",
         "KVTUNE_TEST_API_KEY", "--users", "1", "--duration", "4", "--warmup", "0", "--max-tokens", "4",
         "--arg", "system-tokens=64", "--arg", "user-tokens=16", "--json", str(tmp_path / "load.json")],
        capture_output=True, text=True, env=os.environ | CREDENTIALS, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    load = json.loads((tmp_path / "load.json").read_text())
    assert load["requests"] > 0 and load["errors"] == 0
    assert KEY not in (tmp_path / "load.json").read_text()

    # The gate's own client: a reference measured through the key, then a candidate followed along it.
    gate = QualityGate(max_tokens=4)
    with openai_client.client_for(KEY) as keyed:
        reference = generate(keyed, profile.url, profile.api_model_name, gate.prompts()[:2], gate.max_tokens)
    save_generations(tmp_path / REFERENCE_FILE, reference)
    spec = SweepSpec.model_validate({
        "name": "gate", "base_profile": str(DEFAULT_PROFILE),
        "space": {"max_num_seqs": [4]}, "slo": {"ttft_p99_s": 5}, "quality": gate.model_dump(),
    })  # fmt: skip
    fp8 = profile.model_copy(update={"kv_cache_dtype": "fp8", "kv_cache_dtype_fallback": "auto"})
    check = quality_for(spec, tmp_path, fp8, None)
    assert check is not None
    record = check(profile)
    assert record is not None and record.prompts == len(reference)


def test_up_writes_and_answers_no_secret(keyed_up: tuple[EngineProfile, str, Path]) -> None:
    _profile, control, folder = keyed_up
    answer = httpx.get(f"{control}/engines", timeout=5).text
    assert KEY not in answer and SECRET not in answer
    assert "KVTUNE_TEST_SECRET" in answer  # the name is shown: the user sees what the engine needs
    assert files_holding(folder, KEY, SECRET) == []
    assert files_holding(ARTIFACTS, KEY, SECRET) == []


def test_generated_script_runs_with_sh_and_its_engine_answers(model_path: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    profile, _note = EngineProfile.model_validate(
        keyed_profile_data(env={"KVTUNE_NOTE": f"$(touch {marker})X"}, warmup=[])
    ).adapted_to_host()
    script = tmp_path / "vllm-serve.sh"
    script.write_text(profile.serve_script(model_path, ["made by the credentials test"]))
    assert files_holding(tmp_path, KEY, SECRET) == []
    log = ARTIFACTS / "serve-script.log"
    proc = subprocess.Popen(
        ["sh", str(script)], stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env=os.environ | CREDENTIALS, start_new_session=True,
    )  # fmt: skip
    try:

        def serving() -> bool:
            try:
                return httpx.get(f"{profile.url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(serving, proc, log, 600, "the script's engine")
        with openai_client.client_for(KEY, timeout=120) as keyed:
            answer = openai_client.chat(
                keyed, profile.url, profile.api_model_name,
                [{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
            )  # fmt: skip
        assert answer.strip()
        with httpx.Client(timeout=60) as anonymous:
            assert chat(anonymous, profile.url, profile.api_model_name).status_code == 401
    finally:
        stop_group(proc, grace_s=30)
    assert not marker.exists(), "a profile value ran as a shell command"
    assert KEY not in log.read_text() and SECRET not in log.read_text()


def test_sweep_sends_the_key_and_its_run_folder_holds_no_secret(tmp_path: Path) -> None:
    profile_path = tmp_path / "keyed.yaml"
    profile_path.write_text(yaml.safe_dump(keyed_profile_data()))
    spec = {
        "name": "keyed",
        "base_profile": str(profile_path),
        "space": {"max_num_seqs": [4]},
        "workload": {"args": {"system-tokens": 64, "user-tokens": 16}, "max_tokens": 8, "users": 2},
        "slo": {"ttft_p99_s": 60.0},
        "cache_state": "warm",  # each step re-sends the warm-up prefix, through the key
        "load": {"start_rate": 0.5, "max_rate": 0.5, "bisect_steps": 0, "step_seconds": 6,
                 "warmup_seconds": 1},
        "quality": {"enabled": False},  # the gate's client is checked against the `kvtune up` engine
    }  # fmt: skip
    spec_path = tmp_path / "sweep.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    result = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "sweep", str(spec_path), "--runs-dir", str(runs)],
        capture_output=True, text=True, env=os.environ | CREDENTIALS, timeout=900, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode in (0, 1), output
    run = (runs / "keyed-latest").resolve()
    (result_file,) = run.glob("trials/*/result.json")
    record = json.loads(result_file.read_text())
    step = record["steps"][0]["result"]
    assert step["requests"] > 0 and step["errors"] == 0, step["error_examples"]
    assert files_holding(run, KEY, SECRET) == []
    assert KEY not in output and SECRET not in output
    if result.returncode == 0:
        script = (run / "vllm-serve.sh").read_text()
        assert "KVTUNE_TEST_SECRET" in script and "KVTUNE_TEST_API_KEY" in script
