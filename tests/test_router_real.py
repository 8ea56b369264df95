"""The router in front of two real engines (`kvtune up` of one profile with replicas: 2, one core each, KV
events on, with their replay), run as two router workers on one port: each replica's every process stays on
its own cores, streams pass through unchanged, a killed engine costs no hung request and rejoins, a client
that goes away aborts its upstream request, a prefix-cache reset is seen through the KV events, bad input is
refused before any engine sees it; both workers serve and each routes by the blocks the other sent (the
engines' events reach both); a SIGKILLed worker costs its clients an error, not a hang, and comes back with
its view rebuilt from vLLM's replay."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import psutil
import pytest
import yaml

from kvtune import metrics
from kvtune.engine import free_port
from kvtune.openai_client import sse_events
from kvtune.platform import bound_cores
from tests.helpers import default_profile_data
from tests.helpers_up import running_up

pytestmark = pytest.mark.engine  # every test uses the fleet of two real engines

SYSTEM = "You are a concise assistant for questions about the geography of Europe. " * 12  # ~ 4 KV blocks
MODEL = "smollm2-135m"
REQUEST_TIMEOUT_S = 120


@dataclass(frozen=True)
class Fleet:
    router: str
    control: str
    engines: dict[str, str]  # name -> url

    def engine_status(self) -> list[dict[str, object]]:
        statuses: list[dict[str, object]] = httpx.get(f"{self.control}/engines", timeout=10).json()
        return statuses

    def workers(self) -> list[dict[str, Any]]:
        """The router's workers as the control API lists them (index, pid, own url, restarts, alive)."""
        listed: list[dict[str, Any]] = httpx.get(f"{self.control}/router/workers", timeout=10).json()
        return listed


def worker_metric(url: str, name: str, **labels: str) -> float:
    """NAME (matching LABELS) as one worker reports it on its own port."""
    samples = metrics.scrape(url)
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def router_metric(fleet: Fleet, name: str, **labels: str) -> float:
    """NAME summed over the router's workers (each counts its own share), as the dashboards sum it."""
    return sum(worker_metric(worker["url"], name, **labels) for worker in fleet.workers())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("fleet")
    port, events, replay = free_port(), free_port(), free_port()
    data = default_profile_data(
        name="smol", port=port, replicas=2, kv_events_port=events, kv_events_replay_port=replay,
        max_model_len=1024, kv_cache_memory_bytes="128MiB",
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache
    )  # fmt: skip
    profile = folder / "fleet.yaml"
    profile.write_text(yaml.safe_dump(data))
    control, router_port = free_port(), free_port()
    args = [str(profile), "--log-dir", str(folder / "logs"), "--control-port", str(control),
            "--router", "kv_events", "--router-port", str(router_port), "--router-workers", "2",
            "--max-restarts", "3"]  # fmt: skip
    with running_up(args, "router-up.log", engines=2):
        yield Fleet(
            router=f"http://127.0.0.1:{router_port}",
            control=f"http://127.0.0.1:{control}",
            engines={"smol-0": f"http://127.0.0.1:{port}", "smol-1": f"http://127.0.0.1:{port + 1}"},
        )


def chat(question: str, **extra: object) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0} | extra


def streamed_text(url: str, body: dict[str, object]) -> str:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body | {"stream": True},
                      timeout=REQUEST_TIMEOUT_S) as response:  # fmt: skip
        assert response.status_code == 200
        events = list(sse_events(response.iter_lines()))
    return "".join(
        (c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or []
    )


def wait_for_reported_blocks(fleet: Fleet, done: Callable[[list[float]], bool], what: str) -> None:
    """Until the blocks the router's KV-event view holds for each engine satisfy DONE (a deadline, not a
    guess at how long ZMQ takes on a busy host)."""
    deadline = time.monotonic() + 60
    while not done(held := [
        router_metric(fleet, metrics.ROUTER_REPORTED_BLOCKS, engine=name) for name in fleet.engines
    ]):  # fmt: skip
        assert time.monotonic() < deadline, f"{what}: the router's views hold {held} blocks"
        time.sleep(0.1)


def test_streams_through_the_router_carry_what_the_engine_sends(fleet: Fleet) -> None:
    body = chat("Name the capital of Portugal.")
    direct = streamed_text(fleet.engines["smol-0"], body)
    assert direct
    assert streamed_text(fleet.router, body) == direct
    plain = httpx.post(f"{fleet.router}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S).json()
    assert plain["choices"][0]["message"]["content"] == direct


def test_each_replica_runs_whole_on_its_own_cores_and_the_router_names_the_engines_model_root(
    fleet: Fleet,
) -> None:
    """Not only the compute threads: the API server and the engine core (which busy-waits on its worker)
    stay on the replica's cores, or they would take the other replica's cycles."""
    statuses = {str(status["name"]): status for status in fleet.engine_status()}
    owned: list[frozenset[int]] = []
    for name in sorted(fleet.engines):
        profile = statuses[name]["profile"]
        assert isinstance(profile, dict)
        cores = bound_cores(profile["cpu_threads_bind"])
        assert cores, profile
        leader = psutil.Process(int(str(statuses[name]["pid"])))
        members = [leader, *leader.children(recursive=True)]
        assert len(members) >= 3, members  # the API server, the engine core and its worker
        assert {frozenset(member.cpu_affinity()) for member in members} == {cores}, (name, members)
        owned.append(cores)
    assert not owned[0] & owned[1], owned
    # A client that tokenises (a Locust workload) finds the tokenizer through the router as through an engine.
    (through_router,) = httpx.get(f"{fleet.router}/v1/models", timeout=10).json()["data"]
    (direct,) = httpx.get(f"{fleet.engines['smol-0']}/v1/models", timeout=10).json()["data"]
    assert through_router["root"] == direct["root"] != MODEL, (through_router, direct)


def test_a_shared_prefix_is_routed_by_what_the_engine_reports_and_a_reset_is_seen(fleet: Fleet) -> None:
    before = router_metric(fleet, "kvtune_router_requests_total", reason="kv_events_match")
    for question in ("Capital of Spain?", "Capital of Italy?", "Capital of Greece?"):
        assert (
            httpx.post(
                f"{fleet.router}/v1/chat/completions", json=chat(question), timeout=REQUEST_TIMEOUT_S
            ).status_code
            == 200
        )
    assert router_metric(fleet, "kvtune_router_requests_total", reason="kv_events_match") >= before + 2, (
        "the second and third requests went where the engine reported holding the system prompt"
    )
    # The router's view holds the system prompt's blocks, as the engine reported them.
    wait_for_reported_blocks(fleet, lambda held: sum(held) > 0, "the system prompt's blocks reported")
    # Reset both engines' prefix caches: each publishes AllBlocksCleared, and no engine is preferred.
    # vLLM publishes an engine's events with its next scheduler step, so each gets a tiny request (shorter
    # than a block: it stores none).
    for url in fleet.engines.values():
        assert httpx.post(f"{url}/reset_prefix_cache", timeout=30).status_code == 200
        tiny = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=tiny, timeout=REQUEST_TIMEOUT_S).status_code == 200
    # The events travel over ZMQ: the router has applied them once its view of both engines is empty.
    wait_for_reported_blocks(fleet, lambda held: held == [0, 0], "both views emptied by AllBlocksCleared")
    cleared = router_metric(fleet, "kvtune_router_requests_total", reason="no_prefix_match")
    httpx.post(
        f"{fleet.router}/v1/chat/completions", json=chat("Capital of Malta?"), timeout=REQUEST_TIMEOUT_S
    )
    assert router_metric(fleet, "kvtune_router_requests_total", reason="no_prefix_match") == cleared + 1


def generated(fleet: Fleet) -> float:
    return sum(
        metrics.total(metrics.scrape(url), metrics.GENERATION_TOKENS) for url in fleet.engines.values()
    )


def test_a_client_that_goes_away_aborts_its_upstream_request(fleet: Fleet) -> None:
    wanted = 900
    body = chat("Write a very long story about the Alps.", max_tokens=wanted, ignore_eos=True, stream=True)
    before = generated(fleet)
    with httpx.stream(
        "POST", f"{fleet.router}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as response:
        assert response.status_code == 200
        next(response.iter_raw())  # the first chunk: the request runs on an engine
    # The client closed the connection: the engines stop generating long before the 900 tokens asked for.
    deadline = time.monotonic() + 60
    running = 1.0
    while time.monotonic() < deadline:
        running = sum(
            metrics.total(metrics.scrape(url), metrics.REQUESTS_RUNNING) for url in fleet.engines.values()
        )
        if running == 0:
            break
        time.sleep(0.5)
    assert running == 0, "the upstream request kept running after its client left"
    assert generated(fleet) - before < wanted, (
        "the request ran to the end: its abort never reached the engine"
    )


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b"{oops", 400),
        (b'{"model": "gpt-4", "prompt": "hi"}', 404),
        (json.dumps({"model": MODEL, "prompt": "word " * 1500}).encode(), 400),
    ],
)
def test_bad_input_is_refused_before_any_engine_sees_it(fleet: Fleet, content: bytes, status: int) -> None:
    prompts_before = [
        metrics.total(metrics.scrape(url), metrics.PROMPT_TOKENS) for url in fleet.engines.values()
    ]
    response = httpx.post(
        f"{fleet.router}/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == status and response.json()["error"]["message"]
    prompts_after = [
        metrics.total(metrics.scrape(url), metrics.PROMPT_TOKENS) for url in fleet.engines.values()
    ]
    assert prompts_after == prompts_before


def views(url: str, fleet: Fleet) -> dict[str, float]:
    """The blocks one worker's KV-event view holds, per engine."""
    return {name: worker_metric(url, metrics.ROUTER_REPORTED_BLOCKS, engine=name) for name in fleet.engines}


def test_two_workers_on_one_port_both_serve_and_each_routes_by_what_the_other_sent(fleet: Fleet) -> None:
    first, second = (worker["url"] for worker in fleet.workers())
    served = [worker_metric(url, "kvtune_router_requests_total") for url in (first, second)]
    for index in range(16):  # a new connection each: the kernel spreads them over the workers
        tiny = {"model": MODEL, "prompt": f"Count to {index}.", "max_tokens": 1}
        answer = httpx.post(f"{fleet.router}/v1/completions", json=tiny, timeout=REQUEST_TIMEOUT_S)
        assert answer.status_code == 200
    after = [worker_metric(url, "kvtune_router_requests_total") for url in (first, second)]
    assert after[0] > served[0] and after[1] > served[1], (
        f"one worker took every connection: {served} -> {after}"
    )
    assert sum(after) - sum(served) == 16

    # A system prompt no engine holds yet goes through the first worker only (its own port)...
    system = (
        "You answer questions about the rivers of South America, briefly and exactly. " * 32
    )  # 3 blocks of 128
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Longest river?"}]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": messages}
    before_first = {
        name: worker_metric(first, "kvtune_router_requests_total", engine=name) for name in fleet.engines
    }
    held_before = views(second, fleet)
    assert httpx.post(f"{first}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S).status_code == 200
    chosen = next(
        name for name in fleet.engines
        if worker_metric(first, "kvtune_router_requests_total", engine=name) > before_first[name]
    )  # fmt: skip
    # ...and the engine's events reach the second worker, which never saw the request.
    deadline = time.monotonic() + 60
    while views(second, fleet)[chosen] < held_before[chosen] + 3:
        assert time.monotonic() < deadline, f"the second worker's view of {chosen}: {views(second, fleet)}"
        time.sleep(0.1)
    matched = worker_metric(second, "kvtune_router_requests_total", engine=chosen, reason="kv_events_match")
    messages[1]["content"] = "Which country is its source in?"
    assert (
        httpx.post(f"{second}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S).status_code == 200
    )
    assert (
        worker_metric(second, "kvtune_router_requests_total", engine=chosen, reason="kv_events_match")
        == matched + 1
    ), "the second worker routed the prefix to the engine the first worker had sent it to"


def test_a_killed_worker_costs_an_error_not_a_hang_and_comes_back_rebuilt_from_replay(fleet: Fleet) -> None:
    survivor, victim = fleet.workers()
    body = chat("Tell a very long story about the Andes.", max_tokens=600, ignore_eos=True, stream=True)

    def stream_through_victim() -> str:
        try:
            with httpx.stream("POST", f"{victim['url']}/v1/chat/completions", json=body,
                              timeout=REQUEST_TIMEOUT_S) as response:  # fmt: skip
                for _chunk in response.iter_raw():
                    started.set()
        except httpx.HTTPError as exc:
            return f"error: {type(exc).__name__}"
        return "finished"

    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        outcome = pool.submit(stream_through_victim)
        assert started.wait(REQUEST_TIMEOUT_S), "the stream through the victim never started"
        os.kill(int(victim["pid"]), signal.SIGKILL)
        # The kernel resets the dead worker's connections: the client learns at once, it does not wait
        # for a read timeout (REQUEST_TIMEOUT_S).
        assert outcome.result(timeout=REQUEST_TIMEOUT_S / 2).startswith("error"), "the stream did not end"
    deadline = time.monotonic() + 120
    while True:
        back = fleet.workers()[1]
        if back["alive"] and back["restarts"] == victim["restarts"] + 1 and back["pid"] != victim["pid"]:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{back['url']}/health", timeout=5).status_code == 200:
                    break
        assert time.monotonic() < deadline, f"the killed worker did not come back: {back}"
        time.sleep(0.2)
    still = fleet.workers()[0]
    assert (still["pid"], still["restarts"]) == (survivor["pid"], survivor["restarts"]), (
        "the other kept running"
    )
    # Before any new request, the restarted worker holds what the engines hold: its view, rebuilt from
    # the engines' replay, equals the survivor's, which followed the live stream all along.
    deadline = time.monotonic() + 60
    while (rebuilt := views(back["url"], fleet)) != (live := views(survivor["url"], fleet)) or not any(
        rebuilt.values()
    ):
        assert time.monotonic() < deadline, f"restarted worker's view {rebuilt}, the survivor's {live}"
        time.sleep(0.1)
    assert worker_metric(back["url"], "kvtune_router_requests_total") == 0, "no request reached it yet"


def test_a_killed_engine_costs_no_hung_request_and_takes_traffic_again(fleet: Fleet) -> None:
    victim = next(s for s in fleet.engine_status() if s["name"] == "smol-1")
    restarts = int(str(victim["restarts"]))

    def one(index: int) -> str:
        started = time.monotonic()
        try:
            # Long fixed answers: the victim is mid-answer when it dies, however fast the host.
            body = chat(f"Question {index}?", max_tokens=160, ignore_eos=True)
            response = httpx.post(f"{fleet.router}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"transport error after {time.monotonic() - started:.0f} s: {exc}"
        if response.status_code == 200:
            assert response.json()["choices"], "a 200 carries a whole answer"
            return "ok"
        assert "error" in response.json(), f"not an OpenAI-style error: {response.text[:200]}"
        return f"error {response.status_code}"

    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        # The kill comes while the victim is generating a request: wait until it says so, not for a time.
        deadline = time.monotonic() + 120
        while metrics.total(metrics.scrape(fleet.engines["smol-1"]), metrics.REQUESTS_RUNNING) < 1:
            assert time.monotonic() < deadline, "no request ever ran on smol-1"
            time.sleep(0.05)
        os.kill(int(str(victim["pid"])), signal.SIGKILL)
        outcomes = [f.result(timeout=REQUEST_TIMEOUT_S + 30) for f in futures]
    # Every request ended: answered (by either engine) or refused with an OpenAI-style error; none hung and
    # none lost its connection. The requests the victim was generating are among the errors.
    assert all(o == "ok" or o.startswith("error ") for o in outcomes), outcomes
    assert "ok" in outcomes and any(o.startswith("error ") for o in outcomes), outcomes
    # The supervisor restarts it; once ready it is routed to again.
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status = next(s for s in fleet.engine_status() if s["name"] == "smol-1")
        if status["state"] == "ready" and int(str(status["restarts"])) > restarts:
            break
        time.sleep(2.0)
    else:
        pytest.fail("the killed engine did not come back")
    before = router_metric(fleet, "kvtune_router_requests_total", engine="smol-1")
    for index in range(8):
        body = {"model": MODEL, "prompt": f"{index} " * 40, "max_tokens": 2}
        httpx.post(f"{fleet.router}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert router_metric(fleet, "kvtune_router_requests_total", engine="smol-1") > before
