"""Bad load-test input gets one clear line and exit code 2, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtune.engine import Engine, free_port
from kvtune.loadgen.runner import LoadSpec, LoadTestError, run_load
from tests.helpers_http import Answer, html_200, html_404, serving
from tests.helpers_locust import run_locust


def assert_clear_error(workload: str, host: str, *extra: str, expected: str) -> None:
    result = run_locust(workload, host, *extra, seconds=5)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("kvtune: ")]
    assert expected in line, line


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "does not exist or is not a file; pass an existing JSONL file of prompts"),
        ("", "has no requests; add JSONL lines with 'messages' or 'prompt'"),
        ('{"prompt": "ok"}\n{"prompt": \n', "prompts.jsonl:2: not valid JSON"),
    ],
    ids=["missing", "empty", "malformed"],
)
@pytest.mark.engine
def test_bad_replay_file(content: str | None, expected: str, default_engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    assert_clear_error("replay", default_engine.url, "--replay-file", str(path), expected=expected)


@pytest.mark.engine
def test_replay_without_a_file(default_engine: Engine) -> None:
    expected = "replay-file: the replay workload needs a JSONL file of prompts or chat messages"
    assert_clear_error("replay", default_engine.url, expected=expected)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (html_404, "answered HTTP 404 (text/html), not a model list"),
        (html_200, "answered HTTP 200 (text/html)"),
    ],
    ids=["html-404", "html-200"],
)
def test_host_that_is_not_an_openai_server(answer: Answer, expected: str) -> None:
    with serving(answer) as server:
        assert_clear_error("shared_prefix", server.url, expected=expected)
        assert {seen.method for seen in server.seen} == {"GET"}


def test_host_refusing_connections() -> None:
    host = f"http://127.0.0.1:{free_port()}"
    assert_clear_error("shared_prefix", host, expected=f"cannot reach {host} (ConnectError")


@pytest.mark.engine
def test_model_not_served(default_engine: Engine) -> None:
    expected = f"model 'nope' is not served by {default_engine.url}; it serves: smollm2-135m. Fix --model"
    assert_clear_error("shared_prefix", default_engine.url, "--model", "nope", expected=expected)


@pytest.mark.engine
def test_runner_raises_the_same_clear_error(default_engine: Engine) -> None:
    spec = LoadSpec(url=default_engine.url, model="nope", duration_s=5, warmup_s=0)
    with pytest.raises(LoadTestError, match=r"is not served by .*; it serves: smollm2-135m"):
        run_load(spec)
