"""Router workers without engines: vLLM's own KV-event publisher (tests/kv_publisher.py, its live stream
and replay buffer) feeding a follower directly and through the fan-out; the refusals of
`--router-workers`; the worker's set-up round trip; Prometheus labels per worker."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtune.config_errors import ConfigError
from kvtune.engine import free_port
from kvtune.observability.prometheus_server import ScrapeTarget, scrape_config
from kvtune.processes import stop_group
from kvtune.profile import EngineProfile
from kvtune.router.engine_watch import KvEventSource, follow_kv_events
from kvtune.router.fanout import KvEventFanout
from kvtune.router.policies import EngineState
from kvtune.router.prefix_index import block_hashes
from kvtune.router.proxy_settings import ProxySettings
from kvtune.router.server import RouterOptions, RouterTarget, router_options_for
from kvtune.router.worker import WorkerSetup
from tests.helpers import default_profile_data

BLOCK = 16
TOKENS = list(range(1000, 1048))  # three blocks
CHAIN = block_hashes(TOKENS, BLOCK)
FIRST_TWO = [["stored", [11, 12], None, TOKENS[:32]]]
THIRD = [["stored", [13], 12, TOKENS[32:]]]
REMOVED_13 = [["removed", [13]]]
DEADLINE_S = 60.0


class Publisher:
    """tests/kv_publisher.py in a child process: vLLM's ZmqEventPublisher, as an engine runs it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kv_publisher", str(BLOCK)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self._answer() == "ready"

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        assert self._answer() == "done", "the publisher did not carry out the command"

    def start(self, endpoint: str, replay: str, buffer_steps: int = 10_000) -> None:
        self.send({"start": {"endpoint": endpoint, "replay": replay, "buffer_steps": buffer_steps}})

    def publish(self, events: list[list[Any]]) -> None:
        self.send({"publish": events})


@pytest.fixture(scope="module")
def publisher() -> Iterator[Publisher]:
    started = Publisher()
    try:
        yield started
    finally:
        assert started.proc.stdin is not None
        started.proc.stdin.close()
        stop_group(started.proc, grace_s=5)


def profile(**fields: Any) -> EngineProfile:
    return EngineProfile.model_validate(default_profile_data(**fields))


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def engine() -> EngineState:
    return EngineState(name="e0", url="http://127.0.0.1:9", capacity_blocks=64, ready=True)


async def until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


class Follower:
    """A follower task on its own engine state, with the resyncs it reported."""

    def __init__(self, source: KvEventSource) -> None:
        self.state = engine()
        self.resyncs: list[str] = []
        self.task = asyncio.create_task(
            follow_kv_events(self.state, source, lambda _engine, cause: self.resyncs.append(cause))
        )

    def held(self) -> int:
        return self.state.reported.match(CHAIN)

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def test_a_router_started_after_the_engine_rebuilds_its_view_from_vllm_s_replay(publisher: Publisher) -> None:
    live, replay = endpoints()

    async def scenario() -> None:
        publisher.start(live, replay)
        publisher.publish(FIRST_TWO)  # nobody subscribed yet: these reach no router live
        publisher.publish(THIRD)
        follower = Follower(KvEventSource(live, replay=replay))
        await until(lambda: follower.held() == 3, "the replay's three blocks applied")
        assert follower.state.reported_fresh, "the replay reached batch 0: the view is exact"
        await asyncio.to_thread(publisher.publish, REMOVED_13)  # live, after the replay
        await until(lambda: follower.held() == 2, "the live removal applied after the replay")
        assert follower.resyncs == [], "the replayed batches arriving live again were skipped, no gap"
        await follower.stop()

    asyncio.run(scenario())


def test_an_engine_that_published_nothing_yet_gives_an_exact_empty_view(publisher: Publisher) -> None:
    live, replay = endpoints()

    async def scenario() -> None:
        publisher.start(live, replay)
        started: list[str] = []
        state = engine()
        task = asyncio.create_task(
            follow_kv_events(state, KvEventSource(live, replay=replay), lambda *_: None,
                             on_started=lambda e: started.append(e.name))
        )  # fmt: skip
        await until(lambda: started == ["e0"], "the follower's start reported")
        assert state.reported_fresh and len(state.reported) == 0
        await asyncio.to_thread(publisher.publish, FIRST_TWO)  # batch 0, live
        await until(lambda: state.reported.match(CHAIN) == 2, "the first live batch applied")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def test_without_replay_a_late_router_knows_nothing_and_a_replay_that_lost_batch_0_stays_stale(
    publisher: Publisher,
) -> None:
    async def scenario() -> None:
        live, replay = endpoints()
        publisher.start(live, replay)
        publisher.publish(FIRST_TWO)
        cold = Follower(KvEventSource(live))  # no replay endpoint: the prefix policy's start, empty
        await asyncio.sleep(1.0)
        assert cold.held() == 0 and not cold.state.reported_fresh
        await cold.stop()

        live, replay = endpoints()
        publisher.start(live, replay, buffer_steps=1)  # keeps only the last batch
        publisher.publish(FIRST_TWO)
        publisher.publish(THIRD)
        wrapped = Follower(KvEventSource(live, replay=replay))
        await asyncio.sleep(1.0)
        assert wrapped.held() == 0, "block 13's parent was never replayed: nothing is claimed"
        assert not wrapped.state.reported_fresh
        await wrapped.stop()

    asyncio.run(scenario())


def test_every_worker_hears_every_batch_through_the_fan_out(publisher: Publisher) -> None:
    live, replay = endpoints()
    fanout = KvEventFanout({"e0": live})
    fanout.start()
    try:

        async def scenario() -> None:
            publisher.start(live, replay)
            publisher.publish(FIRST_TWO)
            source = KvEventSource(fanout.subscribe_endpoints["e0"], connect=True, replay=replay)
            workers = [Follower(source), Follower(source)]
            await until(lambda: all(w.held() == 2 for w in workers), "both workers rebuilt by replay")
            await asyncio.to_thread(publisher.publish, THIRD)
            await until(lambda: all(w.held() == 3 for w in workers), "both workers got the live batch")
            late = Follower(source)  # a worker started again later: its view is rebuilt too
            await until(lambda: late.held() == 3, "a restarted worker rebuilt from replay")
            await asyncio.to_thread(publisher.publish, REMOVED_13)
            everyone = [*workers, late]
            await until(lambda: all(w.held() == 2 for w in everyone), "the removal reached all three")
            assert all(w.resyncs == [] for w in everyone)
            for follower in everyone:
                await follower.stop()

        asyncio.run(scenario())
        assert fanout.subscribe_endpoints["e0"].startswith("ipc://")
    finally:
        fanout.stop()
    assert fanout.subscribe_endpoints == {}


def test_a_fan_out_whose_port_is_taken_fails_and_leaves_nothing_bound() -> None:
    live = f"tcp://127.0.0.1:{free_port()}"
    first = KvEventFanout({"e0": live})
    first.start()
    try:
        second = KvEventFanout({"e1": f"tcp://127.0.0.1:{free_port()}", "e0": live})
        with pytest.raises(Exception, match="Address already in use"):
            second.start()
        assert second.subscribe_endpoints == {}
    finally:
        first.stop()


@pytest.mark.parametrize(
    ("choice", "engines", "workers", "kv_events", "message"),
    [
        ("kv_events", 2, 0, True, "--router-workers: 0 must be at least 1"),
        ("none", 2, 2, True, "--router-workers 2: no router runs here (--router none)"),
        ("auto", 1, 3, True, "--router-workers 3: no router runs here (one engine)"),
        (
            "kv_events",
            2,
            2,
            False,
            "--router kv_events (with --router-workers 2): engine 'e0' publishes no KV",
        ),
    ],
)
def test_router_workers_refusals_name_the_flag(
    choice: str, engines: int, workers: int, kv_events: bool, message: str
) -> None:
    profiles = [
        profile(name=f"e{i}", port=8000 + i, kv_events_port=(5557 + i) if kv_events else None)
        for i in range(engines)
    ]
    with pytest.raises(ConfigError) as refused:
        router_options_for(choice, profiles, 8080, 1.5, workers=workers)
    assert message in str(refused.value)


def test_workers_get_their_own_ports_and_their_set_up_survives_the_trip() -> None:
    profiles = [profile(name=f"e{i}", port=8000 + i, kv_events_port=5557 + i) for i in range(2)]
    options = router_options_for("kv_events", profiles, 8080, 1.5, workers=3)
    assert options is not None and options.workers == 3
    assert len(set(options.worker_ports)) == 3 and 8080 not in options.worker_ports
    setup = WorkerSetup(
        1, options.worker_ports[1], options,
        [RouterTarget("e0", "http://127.0.0.1:8000", "ipc:///x/engine-0.sock", 64, True, "tcp://127.0.0.1:5600")],
        ProxySettings(served_model_name="m", block_size=16, api_key="k"), "/models/m",
    )  # fmt: skip
    assert WorkerSetup.decode(setup.encode()) == setup
    single = router_options_for("kv_events", profiles, 8080, 1.5)
    assert single is not None and single.worker_ports == ()


def test_prometheus_scrapes_each_worker_with_its_worker_label() -> None:
    targets = [
        ScrapeTarget("router", "127.0.0.1", port, worker=str(i)) for i, port in enumerate((9101, 9102))
    ]
    config = scrape_config([ScrapeTarget("e0", "127.0.0.1", 8000), *targets], Path("r"), 5)
    static = config["scrape_configs"][0]["static_configs"]
    assert static[0]["labels"] == {"kvtune_engine": "e0"}
    assert [s["labels"] for s in static[1:]] == [
        {"kvtune_engine": "router", "worker": "0"},
        {"kvtune_engine": "router", "worker": "1"},
    ]
    assert RouterOptions("kv_events").worker_ports == ()


@pytest.mark.parametrize(
    ("extra", "kv_events", "message"),
    [
        (["--router-workers", "0"], True, "--router-workers: 0 is out of range; give 1 to 64"),
        (["--router-workers", "2", "--router", "none"], True, "--router-workers 2: no router runs here"),
        (
            ["--router-workers", "2", "--router", "kv_events"],
            False,
            "--router kv_events (with --router-workers 2)",
        ),
    ],
)
def test_kvtune_up_refuses_bad_router_workers_before_anything_starts(
    tmp_path: Path, extra: list[str], kv_events: bool, message: str
) -> None:
    events = {"kv_events_port": free_port()} if kv_events else {}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(default_profile_data(name="fleet", replicas=2, **events)))
    done = subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "up", str(path), "--log-dir", str(tmp_path / "logs"),
         "--control-port", str(free_port()), *extra],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in " ".join((done.stdout + done.stderr).split())
    assert not (tmp_path / "logs").exists(), "nothing started, no log folder made"
