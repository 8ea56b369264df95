"""Credentials on real engines: an engine with an API key refuses requests without it, every kvtune client
(warm-up, the quality gate, the sweep's load) sends it, and no secret value reaches a file kvtune writes or
an API answer.

The session's `kvtune up` engine (`keyed_up`) serves the client checks; the generated `vllm-serve.sh` is
run with `sh` and its engine answers. A keyed sweep, its validation engines included, is checked in
test_validation_real.py, and `kvtune load` with a key in test_load_cli.py.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtune import metrics, openai_client
from kvtune.processes import stop_group
from kvtune.profile import EngineProfile
from kvtune.sweep.quality import QualityGate, generate, save_generations
from kvtune.sweep.quality_hook import REFERENCE_FILE, quality_for
from kvtune.sweep.spec import SweepSpec
from tests.helpers import (
    ARTIFACTS,
    DEFAULT_PROFILE,
    KEYED_API_KEY,
    KEYED_CREDENTIALS,
    KEYED_SECRET,
    KEYED_SYSTEM_PROMPT,
    files_holding,
    keyed_profile_data,
)
from tests.helpers_up import KeyedEngine

pytestmark = pytest.mark.engine

KEY, SECRET, CREDENTIALS, SYSTEM_PROMPT = (
    KEYED_API_KEY,
    KEYED_SECRET,
    KEYED_CREDENTIALS,
    KEYED_SYSTEM_PROMPT,
)


def processes_holding(*values: str) -> list[str]:
    """Every process on the host whose command line holds one of `values` (as `ps` shows it to anyone)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes()
        except OSError:  # gone since the listing
            continue
        if any(value.encode() in argv for value in values):
            found.append(argv.replace(b"\0", b" ").decode(errors="replace")[:200])
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


def test_engine_refuses_requests_without_the_key_and_warm_up_sent_it(keyed_up: KeyedEngine) -> None:
    profile = keyed_up.profile
    with httpx.Client(timeout=60) as anonymous, openai_client.client_for("not-the-key") as wrong:
        assert chat(anonymous, profile.url, profile.api_model_name).status_code == 401
        assert chat(wrong, profile.url, profile.api_model_name).status_code == 401
    with openai_client.client_for(KEY) as keyed:
        assert chat(keyed, profile.url, profile.api_model_name).status_code == 200
        status = keyed.get(f"{keyed_up.control_url}/engines/keyed").json()  # the control API takes the key
        assert status["warmup_done"] is True and status["last_failure"] is None
        # The warm-up went through the key: the system prompt it sent is in the cache, so the same chat
        # now hits it (nothing else sends that prompt).
        before = metrics.total(metrics.scrape(profile.url, keyed), metrics.PREFIX_CACHE_HITS)
        openai_client.chat(
            keyed, profile.url, profile.api_model_name,
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hello."}],
            max_tokens=1,
        )  # fmt: skip
        after = metrics.total(metrics.scrape(profile.url, keyed), metrics.PREFIX_CACHE_HITS)
    assert after - before >= profile.effective_block_size


def test_quality_gate_sends_the_key(
    keyed_up: KeyedEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate's own client (`kvtune load` with a key is tested in test_load_cli.py)."""
    profile = keyed_up.profile
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)  # the gate reads the key where the sweep would: its environment
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
    record = check(profile)  # followed the reference through the key: a 401 would raise here
    assert record is not None and record.prompts == len(reference)


def test_up_writes_and_answers_no_secret(keyed_up: KeyedEngine) -> None:
    assert httpx.get(f"{keyed_up.control_url}/engines", timeout=5).status_code == 401
    bearer = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.get(f"{keyed_up.control_url}/engines", headers=bearer, timeout=5).text
    assert KEY not in answer and SECRET not in answer
    assert "KVTUNE_TEST_SECRET" in answer  # the name is shown: the user sees what the engine needs
    assert files_holding(keyed_up.folder, KEY, SECRET) == []
    assert files_holding(ARTIFACTS, KEY, SECRET) == []
    # kvtune up, its engine and the engine's workers run with the credentials in their environment only.
    assert processes_holding(KEY, SECRET) == []


def test_generated_script_runs_with_sh_and_its_engine_answers(model_path: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    profile, _note = EngineProfile.model_validate(
        keyed_profile_data(env={"KVTUNE_NOTE": f"`touch {marker}`X"}, warmup=[])
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
