"""The chart's warm-up hook's bounds, in-process and with generated inputs (tests/test_warmup_hook.py runs it
as its own program): keys with whitespace and control characters around and inside them, readyTimeoutS
across the whole float range, JSON nested to any depth, URLs with a credential in every position, files that
are not regular files, answers that are huge or never end. Each refusal names its value and the fix and
quotes no credential; the hook's bounds are kvtune's own where both have one."""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import string
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune import documents
from kvtune.helm import warmup_hook as hook
from kvtune.helm.values import values_schema
from kvtune.profile import LONGEST_WAIT_S
from tests.helm_chart import manifests, render_error
from tests.hostile_servers import (
    MIB,
    Exchange,
    HostileServer,
    endless_body,
    hostile_server,
    huge_body,
    json_reply,
    silent,
    slow_loris,
)

__all__ = ["hostile_server"]  # the fixture, imported for pytest

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
SECRET = "sk-PLANTED-bounds-93ad"
VISIBLE = "".join(chr(code) for code in range(0x21, 0x7F))
WHITESPACE = " \t\n\r\x0b\x0c"
# Characters no HTTP header carries: controls, DEL, space, and beyond ASCII (a header is Latin-1 on the wire,
# and vLLM compares the key's UTF-8 bytes).
UNSENDABLE = st.one_of(
    st.characters(max_codepoint=0x20),
    st.just("\x7f"),
    st.characters(min_codepoint=0x80, codec="utf-8"),
)


def test_the_bounds_agree_with_kvtunes_own_and_the_charts_schema() -> None:
    assert hook.MAX_READY_TIMEOUT_S == LONGEST_WAIT_S
    assert hook.MAX_DEPTH == documents.MAX_DOCUMENT_DEPTH
    assert hook.MAX_FILE_BYTES <= documents.MAX_DOCUMENT_BYTES
    ready = values_schema()["properties"]["engine"]["properties"]["readyTimeoutS"]
    assert ready["minimum"] == hook.MIN_READY_TIMEOUT_S
    assert ready["maximum"] == hook.MAX_READY_TIMEOUT_S


# ---- keys --------------------------------------------------------------------------------------------------


@FUZZ
@given(
    core=st.text(VISIBLE, max_size=40),
    before=st.text(WHITESPACE, max_size=4),
    after=st.text(WHITESPACE, min_size=1, max_size=4),
)
def test_a_key_is_stripped_of_whitespace_around_it(core: str, before: str, after: str) -> None:
    key = f"{core}{SECRET}"
    assert hook.api_key({"VLLM_API_KEY": before + key + after}) == (key, True)
    assert hook.api_key({"VLLM_API_KEY": key}) == (key, False)


@FUZZ
@given(
    head=st.text(VISIBLE, max_size=20),
    bad=UNSENDABLE,
    tail=st.text(VISIBLE, max_size=20),
    around=st.text(WHITESPACE, max_size=3),
)
def test_a_key_with_an_unsendable_character_inside_is_refused_without_quoting_it(
    head: str, bad: str, tail: str, around: str
) -> None:
    key = f"{around}{SECRET}{head}{bad}{tail}{SECRET}{around}"
    with pytest.raises(hook.Refused) as refused:
        hook.api_key({"VLLM_API_KEY": key})
    message = str(refused.value)
    assert message.startswith("VLLM_API_KEY: holds ") and "visible ASCII" in message
    assert SECRET not in message and f"{SECRET}{head}" not in message


def test_a_key_longer_than_any_server_reads_is_refused() -> None:
    with pytest.raises(hook.Refused, match="VLLM_API_KEY: longer than 4096 characters"):
        hook.api_key({"VLLM_API_KEY": SECRET * 1000})


# ---- readyTimeoutS -----------------------------------------------------------------------------------------


TIMEOUTS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([1e300, 1e-300, -0.0, 0, 0.999, 1, 1.0, 86400, 86400.0001, 5e-324, math.nan, math.inf]),
)


@FUZZ
@given(value=TIMEOUTS)
def test_ready_timeout_is_seconds_from_one_to_a_day_or_refused_naming_it(value: float) -> None:
    problem = hook.ready_timeout_problem(value)
    if math.isfinite(value) and 1 <= value <= 86400:
        assert problem is None
    else:
        assert problem is not None
        assert problem.startswith("readyTimeoutS: ") and "give seconds from 1 to 86400" in problem
        assert len(problem) < 160


@FUZZ
@given(value=st.one_of(TIMEOUTS, st.text(max_size=5), st.booleans(), st.none(), st.lists(st.integers())))
def test_ready_timeout_in_a_file_is_refused_or_read_never_raising_else(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "prefixes.json"
    path.write_text(f'{{"model": "m", "readyTimeoutS": {json.dumps(value)}, "prefixes": []}}')
    try:
        model, timeout_s, prefixes = hook.read_prefixes(str(path))
    except hook.Refused as refused:
        assert str(refused).startswith(("readyTimeoutS: ", "NaN ", "Infinity ", "-Infinity "))
    else:
        assert (model, prefixes) == ("m", [])
        assert 1 <= timeout_s <= 86400


# ---- nesting -----------------------------------------------------------------------------------------------


def depth_of(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


# Strings full of brackets and escapes, which must not count.
JSON_TEXT = st.text(alphabet=st.sampled_from('[]{}"\\ab\n\u00e9'), max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(JSON_TEXT, inner, max_size=3),
    max_leaves=60,
)


@FUZZ
@given(value=JSON_VALUES, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans())
def test_nesting_depth_is_the_documents_depth(value: Any, indent: int | None, ascii_only: bool) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert hook.nesting_depth(text) == depth_of(value)


@FUZZ
@given(depth=st.integers(min_value=1, max_value=100_000), opener=st.sampled_from(["[", '{"a": ', "[{}, "]))
def test_any_depth_is_refused_past_fifty_without_recursing(tmp_path: Path, depth: int, opener: str) -> None:
    closer = {"[": "]", '{"a": ': "}", "[{}, ": "]"}[opener]
    nested = opener * depth + "1" + closer * depth
    path = tmp_path / "prefixes.json"
    path.write_text(f'{{"model": "m", "readyTimeoutS": 60, "prefixes": {nested}}}')
    started = time.monotonic()
    with pytest.raises(hook.Refused) as refused:
        hook.read_prefixes(str(path))
    assert time.monotonic() - started < 5.0
    if depth + 1 > hook.MAX_DEPTH:
        assert str(refused.value) == "nests more than 50 levels deep (the chart writes three)"
    else:  # read, and refused for its shape
        assert str(refused.value).startswith("prefixes")


# ---- URLs --------------------------------------------------------------------------------------------------

HOSTS = st.sampled_from(["127.0.0.1", "localhost", "engine.default.svc", "[::1]"])
PORTS = st.sampled_from(["", ":8000", ":1", ":65535"])
PATHS = st.sampled_from(["", "/", "/engine", "/a/b/"])
WHERE = st.sampled_from(["password", "user", "user and password", "query", "fragment", "query and user"])


def url_with_secret(scheme: str, host: str, port: str, path: str, where: str, secret: str) -> str:
    userinfo = {"password": f"u:{secret}@", "user": f"{secret}@", "user and password": f"{secret}:{secret}@"}
    authority = userinfo.get(where, f"{secret}@" if where == "query and user" else "") + host + port
    tail = {"query": f"?token={secret}", "fragment": f"#{secret}", "query and user": f"?k={secret}"}
    return f"{scheme}://{authority}{path}{tail.get(where, '')}"


@FUZZ
@given(
    scheme=st.sampled_from(["http", "https"]),
    host=HOSTS,
    port=PORTS,
    path=PATHS,
    where=WHERE,
    extra=st.text(VISIBLE.replace("@", "").replace("/", "").replace("?", "").replace("#", ""), max_size=8),
)
def test_a_url_with_a_credential_anywhere_is_refused_and_shown_without_it(
    scheme: str, host: str, port: str, path: str, where: str, extra: str
) -> None:
    secret = SECRET + extra
    url = url_with_secret(scheme, host, port, path, where, secret)
    shown = hook.shown_url(url)
    assert SECRET not in shown and "***" in shown
    with pytest.raises(hook.Refused) as refused:
        hook.engine_url({"KVTUNE_WARMUP_URL": url})
    message = str(refused.value)
    assert message.startswith("KVTUNE_WARMUP_URL '") and SECRET not in message


@FUZZ
@given(scheme=st.sampled_from(["http", "https"]), host=HOSTS, port=PORTS, path=PATHS)
def test_a_base_url_is_accepted_as_given(scheme: str, host: str, port: str, path: str) -> None:
    url = f"{scheme}://{host}{port}{path}"
    assert hook.engine_url({"KVTUNE_WARMUP_URL": url}) == url.rstrip("/")
    assert hook.shown_url(url) == repr(url)


@FUZZ
@given(url=st.text(max_size=60), secret_at=st.integers(min_value=0, max_value=60))
def test_any_text_as_a_url_is_accepted_or_refused_in_one_line(url: str, secret_at: int) -> None:
    """Whatever the variable holds: a URL or a one-line refusal; a user:password in it is never shown."""
    planted = url[:secret_at] + f"http://u:{SECRET}@h/" + url[secret_at:]
    for text in (url, planted):
        try:
            hook.engine_url({"KVTUNE_WARMUP_URL": text})
        except hook.Refused as refused:
            assert "\n" not in str(refused) and SECRET not in str(refused)
            assert str(refused).startswith("KVTUNE_WARMUP_URL")
        assert SECRET not in hook.shown_url(text)


# ---- files -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["a pipe", "a device", "a folder", "too large", "exactly the cap"])
def test_only_a_regular_file_up_to_the_cap_is_read(tmp_path: Path, kind: str) -> None:
    path = {"a pipe": tmp_path / "fifo", "a device": Path("/dev/zero"), "a folder": tmp_path}.get(
        kind, tmp_path / "file"
    )
    if kind == "a pipe":
        os.mkfifo(path)
    elif kind in ("too large", "exactly the cap"):
        path.write_bytes(b" " * (hook.MAX_FILE_BYTES + (kind == "too large")))
    tracemalloc.start()
    started = time.monotonic()
    try:
        raw = hook.read_regular(str(path))
    except hook.Refused as refused:
        problem = str(refused)
    else:
        problem = ""
        assert len(raw) == hook.MAX_FILE_BYTES
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.monotonic() - started < 2.0  # a pipe nobody writes to would block a plain open for ever
    assert peak < 4 * hook.MAX_FILE_BYTES  # /dev/zero never ends
    assert (
        problem
        == {
            "a pipe": "is a pipe, not a regular file",
            "a device": "is a device or socket, not a regular file",
            "a folder": "is a folder, not a regular file",
            "too large": "is larger than 1024 KiB, more than a ConfigMap holds",
            "exactly the cap": "",
        }[kind]
    )
    if kind == "a pipe":
        assert stat.S_ISFIFO(path.stat().st_mode)


# ---- answers -----------------------------------------------------------------------------------------------


def headers_then_nothing(exchange: Exchange) -> None:
    """A 200 promising a body that never comes (hostile_servers.silent(200) ends its chunked body at once)."""
    exchange.start(200, {"Content-Type": "application/json"}, length=100)
    while exchange.pause(0.5):
        pass


@pytest.mark.parametrize(
    ("route", "problem"),
    [
        (huge_body(400 * MIB), "answer larger than 1024 KiB, not read"),
        (endless_body(), "answer larger than 1024 KiB, not read"),
        (endless_body(chunked=False), "answer larger than 1024 KiB, not read"),
        (slow_loris(interval_s=0.05), "answer not finished within 1.5 s"),
        (slow_loris(interval_s=0.05, chunked=False), "answer not finished within 1.5 s"),
        (silent(), "no answer (timed out)"),
        (headers_then_nothing, "no answer (timed out)"),
        (json_reply({"choices": []}), ""),
    ],
)
def test_an_answer_is_read_in_chunks_within_its_cap_and_deadline(
    hostile_server: HostileServer, route: Any, problem: str
) -> None:
    hostile_server.route("/v1/completions", route)
    tracemalloc.start()
    started = time.monotonic()
    try:
        said = hook.send(f"{hostile_server.url}/v1/completions", 1.5, {"prompt": "x"}, key=SECRET)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    elapsed = time.monotonic() - started
    assert said == problem
    assert elapsed < 1.5 * 2 + 1.0  # the deadline, plus at most one socket read's timeout
    assert peak < 8 * MIB
    assert hostile_server.requests[0].headers["authorization"] == f"Bearer {SECRET}"


# ---- the run, in-process -----------------------------------------------------------------------------------


@pytest.fixture
def caller_alarm() -> Iterator[None]:
    """An alarm of the caller's own (a test runner's timeout), which the hook must hand back."""
    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, _frame: fired.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 300)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired == []


def test_main_in_process_warms_and_hands_the_callers_alarm_back(
    hostile_server: HostileServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], caller_alarm: None
) -> None:
    handler = signal.getsignal(signal.SIGALRM)
    hostile_server.route("/health", json_reply({}))
    hostile_server.route("/v1/completions", json_reply({"choices": []}))
    path = tmp_path / "prefixes.json"
    path.write_text(
        json.dumps({"model": "m", "readyTimeoutS": 30, "prefixes": [{"role": "raw", "text": "t"}]})
    )
    environ = {
        "KVTUNE_WARMUP_URL": hostile_server.url,
        "VLLM_API_KEY": f"{SECRET}\n",
        "KVTUNE_WARMUP_LOG_COPY": "",
    }
    assert hook.main(["warmup_hook.py", str(path)], environ) == hook.EXIT_OK
    out, err = capsys.readouterr()
    assert out == "" and "warmed 1 of 1 prefix(es)" in err and SECRET not in err
    assert signal.getsignal(signal.SIGALRM) is handler
    assert 200 < signal.getitimer(signal.ITIMER_REAL)[0] <= 300


class _Broken(Mapping[str, str]):
    """An environment whose reading fails with a message quoting a secret (a bug's exception, say); only
    where log lines go can be read."""

    def __getitem__(self, key: str) -> str:
        if key == "KVTUNE_WARMUP_LOG_COPY":
            return ""
        raise RuntimeError(f"cannot read {key}: {SECRET}")

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def test_a_failure_of_the_hook_itself_is_one_line_without_its_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caller_alarm: None
) -> None:
    path = tmp_path / "prefixes.json"
    path.write_text(json.dumps({"model": "m", "readyTimeoutS": 30, "prefixes": []}))
    assert hook.main(["warmup_hook.py", str(path)], _Broken()) == hook.EXIT_HOOK_FAILED
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "kvtune warm-up: the hook failed (RuntimeError): a bug in the hook, please report it\n"


@FUZZ
@given(argv=st.lists(st.text(string.printable, max_size=20), max_size=4))
def test_any_arguments_end_in_one_line_and_a_documented_code(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """None names a prefixes file (a folder, a missing file, the wrong count): each is refused in one line."""
    code = hook.main(argv, {"KVTUNE_WARMUP_LOG_COPY": "", "KVTUNE_WARMUP_URL": "http://127.0.0.1:9"})
    _out, err = capsys.readouterr()
    assert code == hook.EXIT_REFUSED
    assert err.count("\n") == 1 and err.startswith("kvtune warm-up: ")


# ---- the chart ---------------------------------------------------------------------------------------------

# Weights from a volume: a hub download would ask for at least 600 s of readyTimeoutS (templates/checks.yaml).
WARM_VALUES = {
    "engine": {"warmup": [{"role": "system", "text": "You answer questions about the handbook."}]},
    "modelSource": {"source": "pvc", "pvc": {"claimName": "weights"}},
}


@pytest.mark.parametrize("ready", [0, 0.5, 1e-300, 1e300, 86400.5, -1])
def test_the_chart_refuses_a_ready_timeout_the_hook_would_refuse(ready: float) -> None:
    assert hook.ready_timeout_problem(ready) is not None
    message = render_error(WARM_VALUES, {"engine": {"readyTimeoutS": ready}})
    assert "/engine/readyTimeoutS" in message, message


@pytest.mark.parametrize("ready", [1, 86400])
def test_the_hook_and_the_prefixes_the_chart_ships_warm_an_engine(
    hostile_server: HostileServer, tmp_path: Path, ready: int
) -> None:
    """The ConfigMap's own two files, run as the pod runs them, at both ends of readyTimeoutS."""
    hostile_server.route("/health", json_reply({}))
    hostile_server.route("/v1/chat/completions", json_reply({"choices": []}))
    docs = manifests(WARM_VALUES, {"engine": {"readyTimeoutS": ready}})
    config = next(
        doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("warmup")
    )
    for name in ("warmup_hook.py", "prefixes.json"):
        (tmp_path / name).write_text(config["data"][name])
    environ = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    environ |= {"KVTUNE_WARMUP_URL": hostile_server.url, "KVTUNE_WARMUP_LOG_COPY": "", "VLLM_API_KEY": SECRET}
    done = subprocess.run(
        [sys.executable, "-I", str(tmp_path / "warmup_hook.py"), str(tmp_path / "prefixes.json")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"at most {ready} s in all" in done.stderr and "warmed 1 of 1 prefix(es)" in done.stderr
    assert SECRET not in done.stdout + done.stderr
