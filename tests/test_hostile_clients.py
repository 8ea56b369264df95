"""The commands that read from a server a user names, run as a user runs them, against servers that stall,
flood, compress, redirect or lie (tests/hostile_servers.py).

`kvtune doctor URL`, `kvtune doctor --prometheus URL` and `kvtune dashboards push --url URL` each meet every
hostile answer in a real subprocess. Each must end on its own (bounds passed through the flags users have:
`--timeout 2`, so a call's worst case is 2 s plus one 2 s read), with its exit-code contract (the doctor:
2 when the server cannot be read, 1 when what it read is broken; push: 2 unreachable, 1 refused later),
one line that says why, no traceback, no password or key echoed, and a bounded memory: a 1 GiB body, endless
or compressed, must not cost more than the cap. The cases run a few at a time (a Python start of the CLI
costs seconds on a busy 2-core host); each case is still its own test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvtune import metrics
from tests.hostile_servers import (
    HTML_MENTIONING_VLLM,
    INVALID_UTF8,
    MIB,
    POOL_LABELS,
    Exchange,
    HostileServer,
    Request,
    Route,
    bad_bucket_bound,
    endless_body,
    gzip_bomb,
    huge_body,
    infinite_pool,
    json_reply,
    non_finite_counter,
    non_finite_gauge,
    raw,
    recorded,
    redirect,
    restart_mid_window,
    silent,
    slow_loris,
    text,
    vllm_metrics,
)
from tests.peak_rss import measured, read_report

TIMEOUT = "2"  # --timeout: each call's deadline, and (capped by it) its socket timeouts
# A case must end by itself well before this: a CLI start under load (~10 s), its calls (a few x 4 s at
# worst), and a wide margin for a busy host. A command without a deadline would never end.
CHILD_DEADLINE_S = 120.0
# The CLI alone peaks near 160 MB; a body read whole would be 1 GiB.
MAX_RSS_MB = 400
BIG = 1024 * MIB
PARALLEL = 4
TOKEN_ENV = "KVTUNE_HOSTILE_GRAFANA_TOKEN"
SECRET = "hunter2-secret"


@dataclass(frozen=True)
class Case:
    """One command against one server set up by `routes`, and what it must end with. In the expected
    texts, {url} is the server's."""

    id: str
    argv: Callable[[str], list[str]]  # the server's URL -> kvtune's arguments
    routes: dict[str, Route]
    code: int
    says: tuple[str, ...] = ()  # on stderr
    prints: tuple[str, ...] = ()  # on stdout
    never: tuple[str, ...] = ()  # not on stdout
    strict_json: bool = False  # stdout parses as RFC 8259 JSON (no NaN / Infinity)
    redirected: str = ""  # a path redirected to a second server, which must receive nothing


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str
    elapsed_s: float
    peak_rss_mb: float
    url: str
    elsewhere_requests: list[Request] = field(default_factory=list)


# ---- the servers' answers ---------------------------------------------------------------------------------

MODELS = json_reply({"object": "list", "data": [{"id": "m", "root": "m", "parent": None}]})


def engine(metrics_route: Route, models: Route = MODELS) -> dict[str, Route]:
    return {"/metrics": metrics_route, "/v1/models": models}


def fake_prometheus(answers: dict[str, str] | None = None) -> Route:
    """Prometheus' instant-query API for one healthy engine: each query answered by what it asks
    (`answers` maps a piece of a query to the value it gets instead, e.g. "+Inf")."""
    answers = answers or {}
    pool = {"__name__": metrics.CACHE_CONFIG_INFO, "job": "kvtune", "instance": "e:8000", **POOL_LABELS}

    def sample(labels: dict[str, str], value: str) -> dict[str, object]:
        return {"metric": labels, "value": [time.time(), value]}

    def route(exchange: Exchange) -> None:
        query = exchange.request.query.get("query", [""])[0]
        result: list[dict[str, object]]
        if metrics.CACHE_CONFIG_INFO in query:
            result = [sample(pool, "1")]
        elif "count by (model_name)" in query:
            result = [sample({"model_name": "m"}, "1")]
        elif metrics.REQUESTS_WAITING_BY_REASON in query:
            result = []
        else:
            value = next((v for piece, v in answers.items() if piece in query), "0")
            result = [sample({}, value)]
        body = {"status": "success", "data": {"resultType": "vector", "result": result}}
        raw(json.dumps(body).encode(), content_type="application/json")(exchange)

    return route


def grafana(health: Route, **more: Route) -> dict[str, Route]:
    """A Grafana whose /api/health answers `health`; `more` maps API paths (folders_kvtune ->
    /api/folders/kvtune) to their answers, the rest answer as an empty Grafana would."""
    routes = {
        "/api/health": health,
        "/api/search": json_reply([]),
        "/api/folders/kvtune": json_reply({"uid": "kvtune", "title": "kvtune"}),
        "/api/dashboards/db": json_reply({"uid": "x", "url": "/d/x", "version": 1}),
    }
    return routes | {"/api/" + name.replace("_", "/"): route for name, route in more.items()}


HEALTHY = json_reply({"database": "ok", "version": "11.3.0"})


def doctor(*extra: str) -> Callable[[str], list[str]]:
    return lambda url: ["doctor", url, "--window", "1", "--timeout", TIMEOUT, *extra]


def doctor_prometheus(*extra: str) -> Callable[[str], list[str]]:
    return lambda url: ["doctor", url, "--prometheus", "--window", "60", "--timeout", TIMEOUT, *extra]


def push(url: str) -> list[str]:
    return ["dashboards", "push", "--url", url, "--token-env", TOKEN_ENV, "--timeout", TIMEOUT]


STALLING = "was still sending after 2 s; the server is stalling"
TOO_BIG = "sent more than 16 MiB; not the server expected"
NOT_ASKED = "which kvtune did not ask for (it accepts gzip, deflate)"
NOT_PROMETHEUS = "not as Prometheus' HTTP API: give a Prometheus server's base URL"

DOCTOR_CASES = [
    Case("metrics-slow-loris", doctor(), engine(slow_loris(0.5)), 2, (f"error: {{url}}/metrics {STALLING}",)),
    Case(
        "metrics-silent",
        doctor(),
        engine(silent()),
        2,
        ("{url}/metrics did not answer within --timeout 2 s; start the engine",),
    ),
    Case("metrics-endless", doctor(), engine(endless_body()), 2, (f"{{url}}/metrics {TOO_BIG}",)),
    Case("metrics-huge", doctor(), engine(huge_body(BIG)), 2, (f"{{url}}/metrics {TOO_BIG}",)),
    Case("metrics-gzip-bomb", doctor(), engine(gzip_bomb(BIG)), 2, (f"{{url}}/metrics {TOO_BIG}",)),
    Case("metrics-gzip-twice", doctor(), engine(gzip_bomb(BIG, layers=2)), 2, ("'gzip, gzip'", NOT_ASKED)),
    Case(
        "metrics-html",
        doctor(),
        engine(text(HTML_MENTIONING_VLLM, content_type="text/html")),
        2,
        (
            "{url}/metrics is not a vLLM engine's /metrics (line 1 is not in the Prometheus text format: "
            "'<!doctype html>",
        ),
    ),
    Case(
        "metrics-invalid-utf8",
        doctor(),
        engine(raw(INVALID_UTF8)),
        2,
        ("{url}/metrics is not a vLLM engine's /metrics (not UTF-8 text: byte",),
    ),
    Case(
        "metrics-redirect",
        doctor(),
        {},
        2,
        ("{url}/metrics answered HTTP 302, a redirect to", "which the doctor does not follow"),
        redirected="/metrics",
    ),
    Case(
        "counter-inf",
        doctor(),
        engine(non_finite_counter("+Inf")),
        1,
        says=("warning: engine's /metrics: 1 sample skipped: vllm:prefix_cache_hits_total is +Inf",),
        prints=("WARN unreadable: no verdict on hit_rate: samples they need were skipped",),
        never=("hit_rate: prefix-cache hit rate",),
    ),
    Case(
        "gauge-nan",
        doctor(),
        engine(non_finite_gauge("NaN")),
        1,
        says=("warning: engine's /metrics: 1 sample skipped: vllm:kv_cache_usage_perc is NaN",),
        prints=("WARN unreadable: no verdict on kv_usage, waiting, kv_size",),
    ),
    Case(
        "bucket-le-abc",
        doctor(),
        engine(bad_bucket_bound("abc")),
        1,
        says=("1 sample skipped: vllm:time_to_first_token_seconds_bucket has le='abc', not a number",),
    ),
    Case(
        "pool-blocks-inf",
        doctor(),
        engine(infinite_pool("num_gpu_blocks", "inf")),
        1,
        says=("warning: engine's /metrics: vllm:cache_config_info's num_gpu_blocks is 'inf', not a whole",),
        prints=("WARN kv_pool: the KV pool is unknown",),
    ),
    Case(
        "restart-mid-window",
        doctor("--json", "--timeout", "30"),  # not a case of time: the run's answers all fit
        engine(restart_mid_window()),
        1,
        prints=(
            '"check": "restart"',
            "the engine restarted in the window (vllm:prefix_cache_hits_total went down from 100 to 90): "
            "its counters started again from zero",
            '"hits": null',
            '"hits": "the engine restarted in the window"',
        ),
        never=("900", '"check": "hit_rate"'),
        strict_json=True,
    ),
    Case(
        "models-slow-loris",
        doctor(),
        engine(vllm_metrics(), models=slow_loris(0.5)),
        0,
        # The last call of the run gets what is left of its --timeout (the window is not counted).
        prints=("{url}/v1/models was still answering when the run's --timeout 2 s ran out",),
    ),
    Case(
        "models-list-and-a-password",
        lambda url: doctor()(url.replace("http://", f"http://user:{SECRET}@")),
        engine(vllm_metrics(), models=json_reply(["m"])),
        0,
        prints=(
            "kvtune doctor http://user:***@127.0.0.1:",
            "/v1/models answered a list, not an object with a 'data' list; pass --model DIR",
        ),
    ),
]

PROMETHEUS_CASES = [
    Case(
        "query-slow-loris",
        doctor_prometheus(),
        {"/api/v1/query": slow_loris(0.5)},
        2,
        (f"{{url}}/api/v1/query {STALLING}",),
    ),
    Case(
        "query-endless",
        doctor_prometheus(),
        {"/api/v1/query": endless_body("application/json")},
        2,
        (TOO_BIG,),
    ),
    Case(
        "query-gzip-bomb",
        doctor_prometheus(),
        {"/api/v1/query": gzip_bomb(BIG, "application/json")},
        2,
        (TOO_BIG,),
    ),
    Case(
        "query-list",
        doctor_prometheus(),
        {"/api/v1/query": json_reply([{"status": "success"}])},
        2,
        ("{url}/api/v1/query answered HTTP 200, a list without a status, " + NOT_PROMETHEUS,),
    ),
    Case(
        "query-wrong-types",
        doctor_prometheus(),
        {
            "/api/v1/query": json_reply(
                {"status": "success", "data": {"resultType": "vector", "result": [{"metric": 1, "value": 5}]}}
            )
        },
        2,
        ("a vector whose result is not a list of samples, " + NOT_PROMETHEUS,),
    ),
    Case(
        "query-html",
        doctor_prometheus(),
        {"/api/v1/query": text(HTML_MENTIONING_VLLM, content_type="text/html")},
        2,
        ("answered HTTP 200, not JSON (Expecting value), " + NOT_PROMETHEUS,),
    ),
    Case(
        "query-nan-literal",
        doctor_prometheus(),
        {"/api/v1/query": raw(b'{"status": "success", "data": NaN}', content_type="application/json")},
        2,
        ("not JSON (NaN is not a JSON number)",),
    ),
    Case(
        "query-redirect",
        doctor_prometheus(),
        {},
        2,
        ("{url}/api/v1/query answered HTTP 302, a redirect to",),
        redirected="/api/v1/query",
    ),
    Case(
        "query-infinite-counter",
        doctor_prometheus("--timeout", "30"),  # not a case of time: the run's ~30 queries all fit
        {"/api/v1/query": fake_prometheus({f"increase({metrics.PREFIX_CACHE_HITS}": "+Inf"})},
        1,
        says=(
            "warning: Prometheus' answers: 1 left out: vllm:prefix_cache_hits_total is +Inf in "
            "Prometheus' answer",
        ),
        prints=("WARN unreadable: no verdict on hit_rate",),
    ),
    Case(
        "query-resets",
        doctor_prometheus("--json", "--timeout", "30"),
        {"/api/v1/query": fake_prometheus({f"resets({metrics.PREFIX_CACHE_HITS}": "1", "kv_cache": "NaN"})},
        1,
        prints=(
            "the engine restarted in the window (Prometheus counts 1 resets of vllm:prefix_cache_hits_total "
            "in the last 60s)",
            '"queries": null',
            '"kv_usage": null',
        ),
        never=('"check": "hit_rate"',),
        strict_json=True,
    ),
]

GRAFANA_UNREACHABLE = "check that the URL is Grafana's own, or raise --timeout"

GRAFANA_CASES = [
    Case(
        "health-slow-loris",
        push,
        grafana(slow_loris(0.5, content_type="application/json")),
        2,
        (f"did not answer within kvtune's bounds ({{url}}/api/health {STALLING}): {GRAFANA_UNREACHABLE}",),
    ),
    Case(
        "health-slow-loris-unframed",
        push,
        grafana(slow_loris(0.5, content_type="application/json", chunked=False)),
        2,
        (f"({{url}}/api/health {STALLING})",),
    ),
    Case(
        "health-silent",
        push,
        grafana(silent()),
        2,
        ("cannot reach Grafana at {url} (no answer within 2 s)",),
    ),
    Case("health-endless", push, grafana(endless_body("application/json")), 2, (TOO_BIG,)),
    Case("health-huge", push, grafana(huge_body(BIG, "application/json")), 2, (TOO_BIG,)),
    Case("health-gzip-bomb", push, grafana(gzip_bomb(BIG, "application/json")), 2, (TOO_BIG,)),
    Case(
        "health-list",
        push,
        grafana(json_reply([{"database": "ok"}])),
        2,
        ("{url} does not answer as Grafana (GET /api/health did not answer Grafana's health document)",),
    ),
    Case(
        "health-html",
        push,
        grafana(text(HTML_MENTIONING_VLLM, content_type="text/html")),
        2,
        ("{url} does not answer as Grafana",),
    ),
    Case(
        "health-redirect",
        push,
        {},
        2,
        ("{url} answered with a redirect to", "which kvtune does not follow"),
        redirected="/api/health",
    ),
    Case(
        "folder-list",
        push,
        grafana(HEALTHY, folders_kvtune=json_reply([{"uid": "kvtune"}])),
        1,
        ("Grafana at {url} answered a list when asked to read folder 'kvtune', not an object",),
    ),
    Case(
        "dashboard-string",
        push,
        grafana(HEALTHY, dashboards_db=json_reply("saved")),
        1,
        ("answered a string when asked to save dashboard",),
    ),
]

CASES = {case.id: case for case in DOCTOR_CASES + PROMETHEUS_CASES + GRAFANA_CASES}


# ---- running them ---------------------------------------------------------------------------------------


def run_case(case: Case, server: HostileServer, elsewhere: HostileServer | None) -> Outcome:
    """The command in a subprocess; its exit code, output, run time and peak RSS (from wait4)."""
    seen: list[Request] = []
    for path, route in case.routes.items():
        server.route(path, route)
    if elsewhere is not None:
        elsewhere.route("/stolen", recorded(text("vllm:num_requests_running 1\n"), seen))
        server.route(case.redirected, redirect(f"{elsewhere.url}/stolen"))
    env = os.environ | {TOKEN_ENV: f"glsa_{SECRET}", "COLUMNS": "400"}
    env.pop("KVTUNE_API_KEY", None)
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "measured.json"
        out_path, err_path = Path(folder) / "stdout.txt", Path(folder) / "stderr.txt"
        argv = measured([sys.executable, "-m", "kvtune.cli", *case.argv(server.url)], report)
        start = time.monotonic()
        with out_path.open("w") as out, err_path.open("w") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, start_new_session=True)
            try:
                proc.wait(timeout=CHILD_DEADLINE_S)
            except subprocess.TimeoutExpired:  # the test then reports the deadline
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        elapsed = time.monotonic() - start
        code, peak_rss = read_report(report) if report.exists() else (proc.returncode, 0)
        return Outcome(
            code, out_path.read_text(), err_path.read_text(), elapsed, peak_rss / 2**20, server.url, seen
        )


@pytest.fixture(scope="module")
def outcomes() -> Iterator[dict[str, Outcome]]:
    """Every case run, PARALLEL at a time, each against its own server(s)."""
    servers = {case_id: HostileServer().start() for case_id in CASES}
    others = {case_id: HostileServer().start() for case_id, case in CASES.items() if case.redirected}
    lock = threading.Lock()
    results: dict[str, Outcome] = {}

    def one(case: Case) -> None:
        outcome = run_case(case, servers[case.id], others.get(case.id))
        with lock:
            results[case.id] = outcome

    try:
        with ThreadPoolExecutor(PARALLEL) as pool:
            list(pool.map(one, CASES.values()))
        yield results
    finally:
        for server in [*servers.values(), *others.values()]:
            server.stop()


def _refuse_constant(constant: str) -> object:
    raise ValueError(f"{constant} in JSON output")


@pytest.mark.parametrize("case_id", list(CASES))
def test_a_hostile_server_gets_a_bounded_one_line_answer(outcomes: dict[str, Outcome], case_id: str) -> None:
    case, outcome = CASES[case_id], outcomes[case_id]
    output = outcome.stdout + outcome.stderr
    shown = (
        f"exit {outcome.code} after {outcome.elapsed_s:.1f} s\nout: {outcome.stdout}\nerr: {outcome.stderr}"
    )
    assert outcome.elapsed_s < CHILD_DEADLINE_S, f"killed at the deadline: {shown}"
    assert outcome.code == case.code, shown
    assert "Traceback" not in output, shown
    assert SECRET not in output, shown
    # Above the bare interpreter's ~10 MB: the figure is the CLI's own, not some other process'.
    assert 50 < outcome.peak_rss_mb < MAX_RSS_MB, f"peak RSS {outcome.peak_rss_mb:.0f} MB: {shown}"
    expected = [(text, outcome.stderr) for text in case.says] + [
        (text, outcome.stdout) for text in case.prints
    ]
    for piece, stream in expected:
        assert piece.replace("{url}", outcome.url) in " ".join(stream.split()), shown
    for absent in case.never:
        # Whole figures only: a window of 1.0029636390027008 s holds "900" but does not say it.
        assert not re.search(rf"(?<![0-9.]){re.escape(absent)}(?![0-9])", outcome.stdout), shown
    if case.code == 2:  # the reason is one line, the error line
        errors = [line for line in outcome.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and not outcome.stdout, shown
    if case.strict_json:
        json.loads(outcome.stdout, parse_constant=_refuse_constant)
    if case.redirected:
        assert outcome.elsewhere_requests == [], "a redirect was followed"


def test_the_slow_loris_is_cut_by_the_deadline_not_by_luck(outcomes: dict[str, Outcome]) -> None:
    # The slow-loris sends a byte every 0.5 s: no read ever times out, only the 2 s deadline ends it.
    for case_id in ("metrics-slow-loris", "query-slow-loris", "health-slow-loris"):
        assert STALLING in outcomes[case_id].stderr, outcomes[case_id].stderr
