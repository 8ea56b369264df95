"""What `kvtune doctor` takes from a user, checked where a user gives it: `--timeout` bounds every answer
and the whole run (a server that never answers ends the doctor at --timeout, not at a socket timeout of its
own, with a message that says the time it waited), `--selector` is label matchers rendered escaped into every
query or one line of refusal before anything is asked, and URL is an http(s) base URL.

Servers are local fakes (tests/hostile_servers.py). Times are checked from below exactly (the doctor waits
what --timeout says) and from above with a wide margin, so a busy host changes no verdict.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune import cli
from kvtune.observability.promql import MATCH_OPERATORS, Matcher, parse_matchers
from tests.hostile_servers import (
    Exchange,
    HostileServer,
    Route,
    hostile_server,
    json_reply,
    silent,
    vllm_metrics,
)
from tests.test_hostile_clients import fake_prometheus

__all__ = ["hostile_server"]  # the fixture, imported for pytest

MODELS = json_reply({"object": "list", "data": [{"id": "m", "root": "m", "parent": None}]})
# Above the times asserted: a CLI run in this process on a loaded 2-core host, with room to spare.
MARGIN_S = 8.0
SECRET = "hunter2-doctor-secret"


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str, float]:
    capsys.readouterr()
    start = time.monotonic()
    try:
        code = cli.main(["doctor", *args])
    except SystemExit as exit_:  # argparse refused a flag's value
        code = exit_.code if isinstance(exit_.code, int) else 1
    elapsed = time.monotonic() - start
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err, elapsed


def delayed(route: Route, seconds: float) -> Route:
    """ROUTE's answer after SECONDS of silence."""

    def answer(exchange: Exchange) -> None:
        if exchange.pause(seconds):
            route(exchange)

    return answer


# ---- --timeout ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timeout_s",
    # 11 s: past the 10 s socket read timeout of kvtune's HTTP policy, where the doctor used to give up
    # while saying it had waited --timeout.
    [2.0, 11.0],
)
def test_a_metrics_endpoint_that_never_answers_ends_the_doctor_at_its_timeout(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer, timeout_s: float
) -> None:
    hostile_server.route("/metrics", silent())
    code, out, err, elapsed = run(capsys, hostile_server.url, "--window", "1", "--timeout", f"{timeout_s:g}")
    assert code == 2 and out == "", err
    said = re.search(r"/metrics did not answer within --timeout ([0-9.]+) s; start the engine", err)
    assert said is not None, err
    # What it says is what it did: it waited the seconds it names, no fewer, and not much more.
    assert float(said[1]) == timeout_s
    assert timeout_s - 0.05 <= elapsed <= timeout_s + MARGIN_S, elapsed
    assert err.count("\n") == 1, err


def test_a_prometheus_that_never_answers_ends_the_doctor_at_its_timeout(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer
) -> None:
    hostile_server.route("/api/v1/query", silent())
    code, out, err, elapsed = run(capsys, hostile_server.url, "--prometheus", "--timeout", "2")
    assert code == 2 and out == "", err
    assert "/api/v1/query did not answer within --timeout 2 s; start Prometheus" in err, err
    assert 1.95 <= elapsed <= 2 + MARGIN_S, elapsed


def test_a_prometheus_slow_to_answer_every_query_ends_the_doctor_at_its_timeout(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer
) -> None:
    # Each of the ~30 queries answered in 0.4 s: each within --timeout, together far beyond it.
    hostile_server.route("/api/v1/query", delayed(fake_prometheus(), 0.4))
    code, out, err, elapsed = run(capsys, hostile_server.url, "--prometheus", "--timeout", "2")
    assert code == 2 and out == "", err
    assert "the run's --timeout 2 s ran out" in err, err
    assert 1.95 <= elapsed <= 2 + MARGIN_S, elapsed
    assert err.count("\n") == 1, err


def test_an_engine_slow_to_answer_ends_the_doctor_within_its_window_and_timeout(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer
) -> None:
    # Every scrape takes 1.5 s, within --timeout 2: the window's scrapes eat what the end of the run has left.
    hostile_server.route("/metrics", delayed(vllm_metrics(), 1.5))
    hostile_server.route("/v1/models", delayed(MODELS, 1.5))
    code, _, err, elapsed = run(capsys, hostile_server.url, "--window", "3", "--timeout", "2")
    assert elapsed <= 3 + 2 + MARGIN_S, elapsed
    assert code in (0, 2), err
    if code == 2:
        assert "the run's --timeout 2 s ran out" in err, err


def test_queries_are_all_evaluated_at_one_time(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer
) -> None:
    """Two queries evaluated a scrape apart could see hits grow without their queries: all read one time."""
    hostile_server.route("/api/v1/query", fake_prometheus())
    code, out, err, _ = run(
        capsys, hostile_server.url, "--prometheus", "--timeout", "30", "--model", "smollm2-135m"
    )
    assert code in (0, 1), out + err
    asked = [request.query for request in hostile_server.requests if request.path == "/api/v1/query"]
    assert len(asked) > 10 and "time" not in asked[0]
    assert {tuple(query["time"]) for query in asked[1:]} == {tuple(asked[1]["time"])}


# ---- --selector -----------------------------------------------------------------------------------------

names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True).filter(lambda name: name[:2] != "__")
matchers = st.lists(
    st.builds(
        Matcher,
        names,
        st.sampled_from(MATCH_OPERATORS),
        st.text(max_size=20).filter(lambda v: "vllm:" not in v),
    ),
    min_size=1,
    max_size=3,
)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[HostileServer]:
    with HostileServer() as server:
        server.route("/api/v1/query", fake_prometheus())
        yield server


def typed(matcher: Matcher, style: str) -> str:
    """A matcher as a user may type it: its value double-, single- or back-quoted (PromQL takes all three)."""
    if style == "single":
        escaped = matcher.value.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
        return f"{matcher.name}{matcher.op}'{escaped}'"
    if style == "raw" and "`" not in matcher.value:
        return f"{matcher.name} {matcher.op} `{matcher.value}`"
    return matcher.render()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    given_matchers=matchers,
    styles=st.lists(st.sampled_from(["double", "single", "raw"]), min_size=3),
    braces=st.booleans(),
)
def test_selector_matchers_reach_every_query_escaped(
    capsys: pytest.CaptureFixture[str],
    prometheus: HostileServer,
    given_matchers: list[Matcher],
    styles: list[str],
    braces: bool,
) -> None:
    typed_text = ",".join(
        typed(matcher, style) for matcher, style in zip(given_matchers, styles, strict=False)
    )
    typed_text = f"{{ {typed_text} }}" if braces else typed_text
    before = len(prometheus.requests)
    code, out, err, _ = run(
        capsys, prometheus.url, "--prometheus", "--selector", typed_text, "--timeout", "30"
    )
    assert code in (0, 1), out + err
    queries = [request.query["query"][0] for request in prometheus.requests[before:]]
    assert len(queries) > 10
    braced = "{" + ", ".join(matcher.render() for matcher in given_matchers) + "}"
    for query in queries:
        # Every metric a query reads carries exactly the matchers given, rendered one way (double-quoted,
        # escaped), whatever their values hold and however they were typed.
        assert len(re.findall(r"vllm:[a-z_]+\{", query)) == query.count(braced) > 0, query
        assert parse_matchers(braced) == given_matchers


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prometheus", "--selector", "job=vllm"], "--selector 'job=vllm' is not a list of label matchers"),
        (
            ["--prometheus", "--selector", 'job="x"} or vector(1) #'],
            "expected a comma before the next matcher at character 8",
        ),
        (
            ["--selector", 'job="x"'],
            "--selector picks an engine's series in Prometheus: give it with --prometheus",
        ),
    ],
)
def test_a_selector_that_is_no_matcher_list_is_refused_before_anything_is_asked(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer, args: list[str], says: str
) -> None:
    code, out, err, _ = run(capsys, hostile_server.url, *args)
    assert code == 2 and out == "", err
    assert says in err and err.count("\n") == 1, err
    assert hostile_server.requests == []


# ---- URL ------------------------------------------------------------------------------------------------

not_http = st.sampled_from(["javascript", "file", "ftp", "data", "ws", "gopher", "mailto", "unix", "HTTP2"])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    scheme=not_http,
    rest=st.sampled_from(["//127.0.0.1:9090", ":alert(1)", "///etc/passwd", "//h/x", ""]),
    prometheus=st.booleans(),
)
def test_only_an_http_url_with_a_host_is_a_server(
    capsys: pytest.CaptureFixture[str], scheme: str, rest: str, prometheus: bool
) -> None:
    url = f"{scheme}:{rest}"
    code, out, err, _ = run(capsys, url, *(["--prometheus"] if prometheus else []))
    assert code == 2 and out == "", err
    assert "expected a base URL such as http://127.0.0.1:" in err and "(http:// or https://, a host)" in err
    assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    "url",
    [
        "http://",
        "https:///metrics",
        "http://:8000",
        "http://host:99999",
        "http://[::1",
        "127.0.0.1:9090",
    ],
)
def test_a_url_without_a_usable_host_is_refused(capsys: pytest.CaptureFixture[str], url: str) -> None:
    code, out, err, _ = run(capsys, url, "--prometheus")
    assert code == 2 and out == "" and "expected a base URL such as http://127.0.0.1:9090" in err, err


@pytest.mark.parametrize(
    "url",
    [
        f"http://127.0.0.1:9090/?password={SECRET}",
        f"http://127.0.0.1:9090/#{SECRET}",
        f"http://u:{SECRET}@127.0.0.1:9090/?x=1",
        f"ftp://u:{SECRET}@127.0.0.1:9090",
    ],
)
def test_a_refused_url_never_shows_a_password_or_query(capsys: pytest.CaptureFixture[str], url: str) -> None:
    code, out, err, _ = run(capsys, url, "--prometheus")
    assert code == 2 and out == "", err
    assert SECRET not in out + err


def test_a_password_in_the_url_is_used_and_never_shown(
    capsys: pytest.CaptureFixture[str], hostile_server: HostileServer
) -> None:
    hostile_server.route("/api/v1/query", fake_prometheus())
    url = hostile_server.url.replace("http://", f"http://user:{SECRET}@")
    code, out, err, _ = run(capsys, url, "--prometheus", "--timeout", "30", "--json")
    assert code in (0, 1), out + err
    assert SECRET not in out + err and "user:***@" in out
    assert all(
        request.headers.get("authorization", "").startswith("Basic ") for request in hostile_server.requests
    )


def test_a_password_in_the_url_beside_an_api_key_is_refused_before_anything_is_asked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, hostile_server: HostileServer
) -> None:
    monkeypatch.setenv("KVTUNE_DOCTOR_TEST_KEY", "sk-doctor-test-key-0123456789")
    url = hostile_server.url.replace("http://", f"http://user:{SECRET}@")
    code, out, err, _ = run(capsys, url, "--api-key-env", "KVTUNE_DOCTOR_TEST_KEY", "--prometheus")
    assert code == 2 and out == "", err
    assert "a request carries one Authorization header" in err and err.count("\n") == 1, err
    assert SECRET not in err and "sk-doctor-test-key" not in err
    assert hostile_server.requests == []
