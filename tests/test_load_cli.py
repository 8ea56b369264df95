"""`kvtune load` from the command line: bad input exits 2 naming the flag before anything runs; API keys.

Servers that are not vLLM are tiny loopback HTTP servers; the key tests run a real engine that requires a key,
behind a recording proxy that shows which requests carried it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtune.engine import free_port
from kvtune.loadgen.runner import LOCUST_HOST_ENV
from kvtune.loadgen.workload_args import API_KEY_ENV, WORKLOAD_ARGS
from tests.helpers import KEYED_API_KEY
from tests.helpers_http import Answer, Handler, html_200, html_404, serving
from tests.helpers_up import KeyedEngine

SMALL = ["--arg", "system-tokens=64", "--arg", "user-tokens=16", "--max-tokens", "4", "--users", "1"]


def openai_without_metrics(handler: Handler) -> None:
    if handler.path == "/v1/models":
        handler.reply(200, "application/json", json.dumps({"data": [{"id": "m", "root": "m"}]}).encode())
    else:
        html_404(handler)


def needs_a_key(handler: Handler) -> None:
    handler.reply(401, "application/json", b'{"error": "Unauthorized"}')


def kvtune_load(
    *argv: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return subprocess.run([sys.executable, "-m", "kvtune.cli", "load", *argv], capture_output=True, text=True,
                          env=base | (env or {}), timeout=timeout, check=False)  # fmt: skip


def assert_refused(result: subprocess.CompletedProcess[str], flag: str, *expected: str) -> None:
    """Exit 2, one `error:` line naming the flag, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    text = " ".join(result.stderr.split())  # rich wraps long lines on a narrow terminal
    assert text.startswith(f"error: {flag}"), text
    for part in expected:
        assert part in text, (part, text)


# ---- bad input: checked before anything runs --------------------------------------------------------------


def test_json_into_a_missing_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "result.json"
    with serving(html_404) as server:
        result = kvtune_load("--url", server.url, "--json", str(target), *SMALL)
    assert_refused(result, "--json", f"folder {target.parent} does not exist")
    assert server.seen == []  # nothing ran: not even a probe of the server


def test_keep_samples_into_a_missing_folder_is_refused_before_the_run(tmp_path: Path) -> None:
    with serving(html_404) as server:
        result = kvtune_load("--url", server.url, "--keep-samples", str(tmp_path / "nope"), *SMALL)
    assert_refused(result, "--keep-samples", "no such folder")
    assert server.seen == []


@pytest.mark.parametrize(
    ("arg", "expected"),
    [
        (
            "sytem-tokens=800",
            "did you mean 'system-tokens'? its flags: system-tokens, user-tokens, prefix-reuse",
        ),
        ("system-tokens=abc", "system-tokens: 'abc' is not an integer"),
        ("user-tokens=-4", "user-tokens: -4 is below 1"),
        ("prefix-reuse=2", "prefix-reuse: 2.0 is outside 0..1"),
        ("system-tokens=99999999999", "system-tokens: 99999999999 is outside 1..1,048,576"),
        ("system-tokens", "expected NAME=VALUE"),
    ],
)
def test_bad_workload_arg_is_refused_before_the_run(arg: str, expected: str, tmp_path: Path) -> None:
    with serving(html_404) as server:
        result = kvtune_load("--url", server.url, "--arg", arg, "--keep-samples", str(tmp_path))
    assert_refused(result, "--arg", expected)
    assert server.seen == [] and list(tmp_path.iterdir()) == []


def test_replay_without_its_file_is_refused(tmp_path: Path) -> None:
    with serving(html_404) as server:
        result = kvtune_load("--url", server.url, "--workload", "replay")
        missing = kvtune_load(
            "--url", server.url, "--workload", "replay", "--arg", f"replay-file={tmp_path}/x"
        )
    assert_refused(result, "--arg", "replay-file: the replay workload needs a JSONL file")
    assert_refused(missing, "--arg", f"replay-file: {tmp_path}/x does not exist")
    assert server.seen == []


def test_api_key_variable_that_is_unset_is_refused() -> None:
    with serving(html_404) as server:
        result = kvtune_load("--url", server.url, "--api-key-env", "KVTUNE_NO_SUCH_KEY", *SMALL)
    assert_refused(result, "--api-key-env KVTUNE_NO_SUCH_KEY", "KVTUNE_NO_SUCH_KEY is unset or empty")
    assert server.seen == []


@pytest.mark.parametrize("how", ["KVTUNE_API_KEY", "--api-key-env"])
def test_a_url_password_beside_an_api_key_is_refused_naming_neither(how: str) -> None:
    password = "s3cr3t-url-password"
    with serving(html_404) as server:
        url = server.url.replace("http://", f"http://ops:{password}@")
        env = {API_KEY_ENV: "engine-key"} if how == API_KEY_ENV else {"MY_ENGINE_KEY": "engine-key"}
        flags = ["--api-key-env", "MY_ENGINE_KEY"] if how == "--api-key-env" else []
        result = kvtune_load("--url", url, *flags, *SMALL, env=env)
    shown = url.replace(password, "***")
    assert_refused(result, f"--url {shown} holds a user and password", "remove user:password@ from the URL")
    assert (API_KEY_ENV if how == API_KEY_ENV else "MY_ENGINE_KEY") in " ".join(result.stderr.split())
    assert password not in result.stdout + result.stderr and "engine-key" not in result.stdout + result.stderr
    assert server.seen == []


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (html_404, "/v1/models answered HTTP 404 (text/html): not a vLLM engine's API"),
        (html_200, "/v1/models is not an OpenAI model list"),
        (openai_without_metrics, "/metrics answered HTTP 404 (text/html): not a vLLM engine's API"),
        (needs_a_key, f"answered HTTP 401: the server needs an API key (set {API_KEY_ENV})"),
    ],
    ids=["html-404", "html-200", "no-metrics", "needs-a-key"],
)
def test_a_server_that_is_not_vllm_is_refused_before_load(
    answer: Answer, expected: str, tmp_path: Path
) -> None:
    with serving(answer) as server:
        result = kvtune_load("--url", server.url, "--keep-samples", str(tmp_path), *SMALL)
    assert_refused(result, f"--url {server.url}", expected)
    assert {seen.method for seen in server.seen} == {"GET"}  # probed, never loaded
    assert list(tmp_path.iterdir()) == []  # no Locust run started


def test_an_unreachable_url_is_refused(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = kvtune_load("--url", url, "--keep-samples", str(tmp_path), *SMALL)
    assert_refused(result, f"--url {url}", f"cannot reach {url}/v1/models (ConnectError")
    assert list(tmp_path.iterdir()) == []


def test_help_lists_every_workload_flag_from_its_definition_with_its_range() -> None:
    result = kvtune_load("--help")
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    for definitions in WORKLOAD_ARGS.values():
        for arg in definitions:
            default = "required" if arg.required else "" if arg.default is None else f"default {arg.default}"
            said = ", ".join(part for part in (arg.bounds, default) if part)
            shown = f"({said})" if said else ""
            assert any(line.split()[:1] == [arg.flag] and line.endswith(shown) for line in lines), arg
    assert f"default: {API_KEY_ENV}, when set" in " ".join(result.stdout.split())


# ---- API keys, on a real engine that requires one ---------------------------------------------------------

KEY = KEYED_API_KEY
KEY_ENV = "KVTUNE_TEST_API_KEY"  # what the keyed profile names in api_key_env


@pytest.fixture
def keyed_engine(keyed_up: KeyedEngine) -> KeyedEngine:
    """The session's keyed engine (`kvtune up` of a profile with an API key), shared with other tests."""
    return keyed_up


def forward_to(upstream: str) -> Answer:
    """A recording proxy: relays each request (streamed answers as they come) to `upstream`."""

    def answer(handler: Handler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {k: v for k, v in handler.headers.items() if k.lower() in ("authorization", "content-type")}
        with (
            httpx.Client(timeout=300) as client,
            client.stream(
                handler.command, upstream + handler.path, content=body, headers=headers
            ) as response,
        ):
            handler.send_response(response.status_code)
            handler.send_header("Content-Type", response.headers.get("content-type", "text/plain"))
            handler.send_header("Connection", "close")
            handler.end_headers()
            for chunk in response.iter_bytes():
                handler.wfile.write(chunk)
                handler.wfile.flush()
        handler.close_connection = True

    return answer


def locust_processes(url: str) -> dict[int, tuple[str, str]]:
    """(command line, environment) of every live Locust process sent to `url` (in its environment)."""
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "locust" in cmdline:
                environ = (proc / "environ").read_bytes().replace(b"\0", b"\n").decode(errors="replace")
                if f"{LOCUST_HOST_ENV}={url}" in environ.splitlines():
                    found[int(proc.name)] = (cmdline, environ)
        except OSError:
            continue
    return found


@pytest.mark.engine
def test_load_sends_the_key_on_every_request_and_never_on_a_command_line(
    keyed_engine: KeyedEngine, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    with serving(forward_to(keyed_engine.url)) as proxy:
        argv = [sys.executable, "-m", "kvtune.cli", "load", "--url", proxy.url, "--api-key-env", KEY_ENV,
                "--duration", "4", "--warmup", "0", "--json", str(out), *SMALL]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV} | {KEY_ENV: KEY}
        with subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        ) as run:
            seen_locust: dict[int, tuple[str, str]] = {}
            while run.poll() is None:
                seen_locust |= locust_processes(proxy.url)
                time.sleep(0.5)
            stdout, stderr = run.communicate()
    assert run.returncode == 0, stdout + stderr
    assert json.loads(out.read_text())["requests"] > 0 and KEY not in out.read_text()
    assert seen_locust, "the Locust process was not seen running"
    for cmdline, environ in seen_locust.values():
        assert KEY not in cmdline and proxy.url not in cmdline, cmdline  # the URL may hold a password
        assert f"{API_KEY_ENV}={KEY}" in environ.splitlines()
    paths = {(seen.method, seen.path.split("?")[0]) for seen in proxy.seen}
    # The runner's probe and scrapes, Locust's model discovery and reuse scrapes, and the load itself.
    assert {("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/chat/completions")} <= paths, paths
    assert {seen.authorization for seen in proxy.seen} == {f"Bearer {KEY}"}


@pytest.mark.engine
def test_load_reads_KVTUNE_API_KEY_when_no_flag_names_a_variable(keyed_engine: KeyedEngine) -> None:
    result = kvtune_load("--url", keyed_engine.url, "--duration", "3", "--warmup", "0", *SMALL,
                         env={API_KEY_ENV: KEY}, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TTFT" in result.stdout


@pytest.mark.engine
def test_load_without_the_key_or_with_a_wrong_one_is_refused(keyed_engine: KeyedEngine) -> None:
    anonymous = kvtune_load("--url", keyed_engine.url, *SMALL)
    wrong = kvtune_load("--url", keyed_engine.url, *SMALL, env={API_KEY_ENV: "not-the-key"})
    assert_refused(anonymous, f"--url {keyed_engine.url}", f"the server needs an API key (set {API_KEY_ENV})")
    assert_refused(wrong, f"--url {keyed_engine.url}", "the server refused the API key given")
    assert (
        httpx.get(f"{keyed_engine.url}/v1/models", timeout=10).status_code == 401
    )  # the engine does guard it
