"""`kvtune doctor` against /metrics bodies no single vLLM engine exports, generated: hits above queries,
histogram buckets that go down, negative counts and gauges, a KV usage above 100%, a series exported twice,
and windows whose scrapes are each an engine's but whose growth is not (hits growing faster than queries).

Each is served by a local fake engine (tests/hostile_servers.py) and run through the command line in this
process; each must end with exit 2 and one line naming the series and saying why, no traceback, and nothing
on stdout (no verdict). Values that are no number (NaN, +Inf) are not impossible but unreadable: those
samples are skipped and named, the checks that need them give no verdict (exit 1), as before.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune import cli, metrics
from tests.hostile_servers import TTFT_BOUNDS, HostileServer, VllmMetrics, json_reply, sequence, text

MODELS = json_reply({"object": "list", "data": [{"id": "m", "root": "m", "parent": None}]})
LABELS = '{engine="0",model_name="m"}'
ONE_ENGINE = "these numbers cannot come from one vLLM engine"
FIX = "check that URL points at one vLLM engine"
# The fields of VllmMetrics that count (never negative) and the metric each one is.
COUNTS = {
    "hits": metrics.PREFIX_CACHE_HITS,
    "queries": metrics.PREFIX_CACHE_QUERIES,
    "preemptions": metrics.PREEMPTIONS,
    "prompt_tokens": metrics.PROMPT_TOKENS,
    "generation_tokens": metrics.GENERATION_TOKENS,
    "finished": metrics.REQUEST_SUCCESS,
    "running": metrics.REQUESTS_RUNNING,
    "waiting": metrics.REQUESTS_WAITING,
    "kv_usage": metrics.KV_CACHE_USAGE,
}
# Those a check needs: a value that is no number there leaves that check without a verdict (a warning).
JUDGED = ("hits", "queries", "preemptions", "running", "waiting", "kv_usage")


@dataclass(frozen=True)
class Hostile:
    """What the engine answers at each scrape, and what the doctor must say of it."""

    scrapes: tuple[str, ...]
    code: int
    says: tuple[str, ...]  # each on stderr


@pytest.fixture(scope="module")
def engine() -> Iterator[HostileServer]:
    with HostileServer() as server:
        server.route("/v1/models", MODELS)
        yield server


def number(value: float) -> str:
    """A value as an exposition line writes it."""
    return repr(float(value))


def with_value(field: str, value: str) -> str:
    """A healthy engine's /metrics with one of VllmMetrics' fields set to VALUE."""
    changes: dict[str, Any] = {field: value}
    return VllmMetrics(**changes).text()


finite = st.floats(0, 1e12, allow_nan=False)
counts = st.integers(0, 10**12).map(float)  # a bucket counts observations: whole numbers


@st.composite
def hostile(draw: st.DrawFn) -> Hostile:
    kind = draw(st.sampled_from(["hits", "buckets", "negative", "usage", "twice", "no-number"]))
    if kind == "hits":
        queries = draw(finite)
        hits = queries + draw(st.floats(1, 1e12)) if draw(st.booleans()) else queries * 50 + 1
        body = VllmMetrics(hits=number(hits), queries=number(queries)).text()
        says = (
            f"{metrics.PREFIX_CACHE_HITS}{LABELS} = {hits:,.6g} exceeds "
            f"{metrics.PREFIX_CACHE_QUERIES}{LABELS} = {queries:,.6g}: {ONE_ENGINE}; {FIX}",
        )
        return Hostile((body,), 2, says)
    if kind == "buckets":
        drawn = draw(st.lists(counts, min_size=len(TTFT_BOUNDS), max_size=len(TTFT_BOUNDS)))
        down = draw(st.integers(0, len(drawn) - 2))
        drawn[down] = max(drawn[down], 1.0)
        drawn[down + 1] = draw(
            st.integers(0, int(drawn[down]) - 1).map(float)
        )  # one observation less, or more
        buckets = tuple(zip(TTFT_BOUNDS, map(number, drawn), strict=True))
        body = VllmMetrics(ttft_buckets=buckets, ttft_count=number(drawn[-1])).text()
        name = f"{metrics.TTFT_SECONDS}_bucket{LABELS}"
        return Hostile((body,), 2, (f"{name} has ", "so they never go down", ONE_ENGINE))
    if kind == "negative":
        field = draw(st.sampled_from(sorted(COUNTS)))
        value = -draw(st.floats(1e-9, 1e12))
        body = with_value(field, number(value))
        return Hostile(
            (body,), 2, (f"{COUNTS[field]}{LABELS} = {value:g}: it counts, so it is never negative",)
        )
    if kind == "usage":
        value = draw(st.floats(1, 1e12, exclude_min=True))
        body = VllmMetrics(kv_usage=number(value)).text()
        return Hostile(
            (body,), 2, (f"{metrics.KV_CACHE_USAGE}{LABELS} = {value:g}: it is a share, at most 1",)
        )
    if kind == "twice":
        body = VllmMetrics().text()
        lines = body.splitlines()
        line = draw(st.sampled_from([line for line in lines if line.startswith("vllm:")]))
        name, rest = line.split("{", 1)
        labels = dict(pair.split("=", 1) for pair in rest.rsplit("}", 1)[0].split('",'))
        shown = metrics.series(name, {k: v.strip('"') for k, v in labels.items()})
        again = f"{line.rsplit(' ', 1)[0]} {number(draw(finite))}"  # the same series, any value
        at = draw(st.integers(lines.index(line) + 1, len(lines)))
        body = "\n".join([*lines[:at], again, *lines[at:]]) + "\n"
        return Hostile((body,), 2, (f"{shown} is exported twice in one scrape: {ONE_ENGINE}",))
    field = draw(st.sampled_from(JUDGED))
    word = draw(st.sampled_from(["NaN", "+Inf", "-Inf"]))
    body = with_value(field, word)
    return Hostile((body,), 1, (f"warning: engine's /metrics: 1 sample skipped: {COUNTS[field]} is {word}",))


@st.composite
def outgrown(draw: st.DrawFn) -> Hostile:
    """Two scrapes that are each one engine's, between which hits grew faster than queries."""
    queries = draw(st.integers(1, 10**9))
    grew = draw(st.integers(0, 10**6))
    extra = draw(st.integers(1, queries))
    hits = draw(st.integers(0, queries - extra))
    before = VllmMetrics(hits=str(hits), queries=str(queries)).text()
    after = VllmMetrics(hits=str(hits + grew + extra), queries=str(queries + grew)).text()
    says = (
        f"{metrics.PREFIX_CACHE_HITS}'s increase over the window = {grew + extra:,.6g} exceeds "
        f"{metrics.PREFIX_CACHE_QUERIES}'s increase over the window = {grew:,.6g}: {ONE_ENGINE}; {FIX}",
    )
    return Hostile((before, after), 2, says)


def doctor(capsys: pytest.CaptureFixture[str], engine: HostileServer, case: Hostile) -> tuple[str, str]:
    engine.route("/metrics", sequence(*(text(body) for body in case.scrapes)))
    capsys.readouterr()
    code = cli.main(["doctor", engine.url, "--window", "1", "--timeout", "30"])
    out, err = capsys.readouterr()
    shown = f"exit {code}\nout: {out}\nerr: {err}"
    assert code == case.code, shown
    assert "Traceback" not in out + err, shown
    flat = " ".join(err.split())
    for says in case.says:
        assert says in flat, f"{says!r} not in: {flat}"
    return out, err


def assert_refused(out: str, err: str, engine: HostileServer) -> None:
    """Exit 2's shape: one line on stderr naming the engine's /metrics, and no verdict at all."""
    assert out == "", out
    assert err.startswith(f"error: {engine.url}/metrics: ") and err.count("\n") == 1, err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=hostile())
def test_a_scrape_no_engine_exports_is_refused_naming_the_series(
    capsys: pytest.CaptureFixture[str], engine: HostileServer, case: Hostile
) -> None:
    out, err = doctor(capsys, engine, case)
    if case.code == 2:
        assert_refused(out, err, engine)
    else:  # unreadable, not impossible: the rest is judged, and what could not be is said
        assert "WARN unreadable: no verdict on" in out, out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=outgrown())
def test_a_window_no_engine_has_is_refused_naming_the_series(
    capsys: pytest.CaptureFixture[str], engine: HostileServer, case: Hostile
) -> None:
    out, err = doctor(capsys, engine, case)
    assert_refused(out, err, engine)


def test_hits_fifty_times_the_queries_is_refused_as_a_user_runs_it(engine: HostileServer) -> None:
    """The case that was reported "hit rate 5000%: healthy", in a real process."""
    engine.route("/metrics", text(VllmMetrics(hits="50000", queries="1000").text()))
    result = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "doctor", engine.url, "--window", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr == (
        f"error: {engine.url}/metrics: {metrics.PREFIX_CACHE_HITS}{LABELS} = 50,000 exceeds "
        f"{metrics.PREFIX_CACHE_QUERIES}{LABELS} = 1,000: {ONE_ENGINE}; {FIX} (not a proxy or exporter that "
        "merges or rewrites them)\n"
    )
