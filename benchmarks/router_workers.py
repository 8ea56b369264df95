"""Routers that do not see everything: several router workers, a router restarted mid-run, traffic sent
to an engine directly, and vllm-router (the peer a user would pick) on the same fleet.

One fleet for the whole run: `kvtune up` of two engines (one core each, the KV pressure of
benchmarks.router: 24-block pools; KV events with their replay; vLLM's render endpoint on for
vllm-router's cache_aware), started once with `--router none`. Each router is then started in front of
them, measured and stopped, and both engines' prefix caches are reset before every run
(`/reset_prefix_cache`: every run starts from empty pools, as a cold fleet would; the KV events carry the
reset to kvtune's views). kvtune's routers are `RouterWorkers`, the processes `kvtune up --router-workers N`
runs (1 or 2 workers; with 1, the router alone in its process, as in `kvtune up`). Each configuration runs
`--repeats` times, the order rotated each round, so a drift of the host spreads over all of them.

- main: benchmarks.router's chats (6 shared 700-token system prompts, 24 sessions of 3 turns, 4 users)
  through kvtune kv_events and prefix with 1 and 2 workers, and vllm-router cache_aware and round_robin;
- restart: 48 sessions through 2 workers; once a third of the turns are answered every worker is
  SIGKILLed and `RouterWorkers` starts them again (the users retry a turn whose connection failed); the
  fleet's hit rate over the minute after the kill, kv_events (views rebuilt from vLLM's replay) vs prefix
  (its LRU starts empty);
- direct: one of the 4 users sends its sessions straight to engine 0, past the router (1 worker).

Targets: with 2 workers, kv_events' hit rate >= 0.98x its own with 1 worker (means), and above prefix's
with 2 workers by more than the spread (kv_events' worst run above prefix's best); the rest is reported
(restart, direct, vllm-router rows, kvtune's best vs cache_aware as a ratio).

    python -m benchmarks.router_workers [--repeats 3] [--variants main,restart,direct]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.table import Table

from benchmarks import peer_router
from benchmarks.router import (
    MODEL,
    Clients,
    Workload,
    console,
    conversations,
    engine_profile,
    fleet_hit_rate,
    kvtune_up,
    run_sessions,
    scrape_all,
    verdicts_passed,
)
from kvtune import metrics
from kvtune.engine import free_port
from kvtune.loadgen.text import TextMaker, load_tokenizer
from kvtune.model_store import ensure_model
from kvtune.profile import EngineProfile
from kvtune.router.fleet import expand_replicas
from kvtune.router.server import fleet_targets, router_options_for
from kvtune.router.workers import RouterWorkers

RESTART_WINDOW_S = 60.0
KVTUNE = ("kv_events", "prefix")


@dataclass(frozen=True)
class Config:
    """One router in front of the fleet: kvtune's POLICY with WORKERS processes, or vllm-router's."""

    policy: str
    workers: int = 1
    peer: bool = False

    @property
    def label(self) -> str:
        if self.peer:
            return f"vllm-router {self.policy}"
        return f"{self.policy} x{self.workers}"


@dataclass
class Run:
    variant: str
    config: str
    repeat: int
    hit_rate: float
    requests: int
    errors: int
    wall_s: float
    ttft_p50_s: float
    decisions: dict[str, float]
    after_restart_hit_rate: float | None = None
    restart_view_blocks: list[float] | None = None  # the restarted workers' KV-event views, at first read


class Fleet:
    """The two engines (started once) and the routers put in front of them in turn."""

    def __init__(self, data: dict[str, Any], engines: list[str], model_path: str, folder: Path) -> None:
        self.data = data
        self.engines = engines
        self.model_path = model_path
        self.folder = folder
        base = EngineProfile.model_validate(data)
        self.profiles = expand_replicas(base)

    def reset(self) -> None:
        """Empty both engines' prefix caches (vLLM refuses while requests run: the previous run is over)."""
        for url in self.engines:
            httpx.post(f"{url}/reset_prefix_cache", timeout=60).raise_for_status()

    @contextlib.contextmanager
    def router(self, config: Config, tag: str) -> Iterator[tuple[str, RouterWorkers | None]]:
        """CONFIG in front of the engines: (its URL, kvtune's workers when it is kvtune's)."""
        port = free_port()
        if config.peer:
            log = self.folder / f"vllm-router-{tag}.log"
            with peer_router.vllm_router(config.policy, self.engines, port, log, MODEL) as url:
                yield url, None
            return
        options = router_options_for(config.policy, self.profiles, port, 1.5, workers=config.workers)
        assert options is not None  # two engines and a policy: a router
        if config.workers == 1:  # one worker process, as `kvtune up` runs the router alone
            options = dataclasses.replace(options, worker_ports=(free_port(),))
        settings, targets = fleet_targets(options, self.profiles, self.model_path)
        workers = RouterWorkers(options, targets, settings, self.model_path, self.folder / f"router-{tag}")
        workers.start()
        try:
            unseen = workers.wait_seen_ready([p.name for p in self.profiles])
            if unseen:
                raise RuntimeError(f"{config.label}: the router does not see {unseen} ready")
            yield f"http://127.0.0.1:{port}", workers
        finally:
            workers.stop()


def decisions(workers: RouterWorkers | None) -> dict[str, float]:
    """The router's decisions by reason, summed over its workers (vllm-router's are not read here)."""
    reasons: dict[str, float] = {}
    for status in workers.statuses() if workers is not None else []:
        for sample in metrics.scrape(status.url):
            if sample.name == metrics.ROUTER_REQUESTS:
                reason = sample.labels["reason"]
                reasons[reason] = reasons.get(reason, 0.0) + sample.value
    return reasons


def view_blocks(workers: RouterWorkers) -> list[float]:
    """Each worker's KV-event views, blocks summed over the engines."""
    return [
        metrics.total(metrics.scrape(status.url), metrics.ROUTER_REPORTED_BLOCKS)
        for status in workers.statuses()
    ]


class Restarter:
    """Kills every router worker once a third of the turns are answered; then reads the fleet's hit rate
    over the next RESTART_WINDOW_S (from a thread: the users keep going)."""

    def __init__(self, fleet: Fleet, workers: RouterWorkers, turns: int) -> None:
        self.fleet, self.workers, self.at = fleet, workers, turns // 3
        self.killed = threading.Event()
        self.hit_rate: float | None = None
        self.views: list[float] | None = None
        self._thread = threading.Thread(target=self._after_kill, daemon=True)

    def on_turn(self, answered: int) -> None:
        if answered >= self.at and not self.killed.is_set():
            self.killed.set()
            self._thread.start()

    def _after_kill(self) -> None:
        before = scrape_all(self.fleet.engines)
        old = {s.index: s.pid for s in self.workers.statuses()}
        for pid in old.values():
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        # The restarted workers' views before they route anything (they load a tokenizer first).
        while time.monotonic() - started < RESTART_WINDOW_S:
            statuses = self.workers.statuses()
            if all(s.alive and s.pid != old[s.index] for s in statuses):
                with contextlib.suppress(httpx.HTTPError):
                    self.views = view_blocks(self.workers)
                    break
            time.sleep(0.05)
        time.sleep(max(0.0, RESTART_WINDOW_S - (time.monotonic() - started)))
        self.hit_rate = fleet_hit_rate(before, scrape_all(self.fleet.engines))

    def join(self) -> None:
        if self.killed.is_set():
            self._thread.join()


def measure(fleet: Fleet, variant: str, config: Config, repeat: int, workload: Workload,
            sessions: list[tuple[str, list[str]]]) -> Run:  # fmt: skip
    tag = f"{variant}-{config.label.replace(' ', '-')}-{repeat}"
    console.print(f"[bold]{variant}[/bold] {config.label} (run {repeat + 1})")
    fleet.reset()
    with fleet.router(config, tag) as (url, workers):
        fronts: tuple[str, ...] = (url,)
        if variant == "direct":  # user 0 of 4 calls engine 0 itself
            fronts = (fleet.engines[0], url, url, url)
        restarter = None
        if variant == "restart" and workers is not None:
            restarter = Restarter(fleet, workers, len(sessions) * workload.turns)
        on_turn: Callable[[int], None] | None = restarter.on_turn if restarter else None
        clients = Clients(fronts, retries=200 if restarter else 0, retry_pause_s=0.25, on_turn=on_turn)
        before = scrape_all(fleet.engines)
        ttfts, errors, wall = asyncio.run(run_sessions(clients, workload, sessions, []))
        after = scrape_all(fleet.engines)
        if restarter is not None:
            restarter.join()
        reasons = decisions(workers)
    run = Run(
        variant, config.label, repeat, fleet_hit_rate(before, after), len(ttfts), errors, wall,
        statistics.median(ttfts) if ttfts else float("nan"), reasons,
        restarter.hit_rate if restarter else None, restarter.views if restarter else None,
    )  # fmt: skip
    extra = f", the minute after the restart {run.after_restart_hit_rate:.1%}" if restarter else ""
    console.print(
        f"  hit rate {run.hit_rate:.1%}{extra}, {run.requests} answers, {errors} errors, {wall:.0f} s"
    )
    return run


def plan(variants: list[str]) -> list[tuple[str, list[Config]]]:
    configs = {
        "main": [Config(p, w) for p in KVTUNE for w in (1, 2)]
        + [Config(p, peer=True) for p in peer_router.PEER_POLICIES],
        "restart": [Config(p, 2) for p in KVTUNE],
        "direct": [Config(p, 1) for p in KVTUNE],
    }
    return [(variant, configs[variant]) for variant in variants]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.router_workers", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration (default 3)")
    parser.add_argument("--variants", default="main,restart,direct")
    args = parser.parse_args(argv)
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in ("main", "restart", "direct")]
    if unknown or args.repeats < 1:
        parser.error(
            f"--variants: {unknown[0]!r} is not one of main, restart, direct"
            if unknown
            else "--repeats: at least 1"
        )
    model_path = str(ensure_model(MODEL))
    maker = TextMaker(load_tokenizer(model_path))
    workload = Workload(prefixes=6, prefix_tokens=700, sessions=24, turns=3, question_tokens=40,
                        max_tokens=16, concurrency=4, seed=7)  # fmt: skip
    long_workload = dataclasses.replace(workload, sessions=48)
    sessions = {"main": conversations(workload, maker), "direct": conversations(workload, maker),
                "restart": conversations(long_workload, maker)}  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="kvtune-router-workers-bench-"))
    data = engine_profile(pressure=True) | {
        "name": "fleet", "port": free_port(), "replicas": 2, "kv_events_port": free_port(),
        "kv_events_replay_port": free_port(), "env": {"VLLM_SERVER_DEV_MODE": "1"},
        "extra_args": list(peer_router.ENGINE_ARGS),
    }  # fmt: skip
    runs: list[Run] = []
    console.print(f"vllm-router {peer_router.vllm_router_version()}; results and logs in {folder}")
    with kvtune_up("fleet", data, ["--router", "none"], folder) as engines:
        fleet = Fleet(data, engines, model_path, folder)
        for repeat in range(args.repeats):
            for variant, configs in plan(chosen):
                shift = repeat % len(configs)
                for config in configs[shift:] + configs[:shift]:
                    chosen_workload = long_workload if variant == "restart" else workload
                    runs.append(measure(fleet, variant, config, repeat, chosen_workload, sessions[variant]))
                    save(folder, runs)  # what is measured stays on disk, whatever comes next
    passed = report(runs)
    console.print(f"results and logs in {folder}")
    return 0 if passed else 1


def save(folder: Path, runs: list[Run]) -> None:
    (folder / "results.json").write_text(json.dumps([dataclasses.asdict(run) for run in runs], indent=2))


def _rates(runs: list[Run], variant: str, config: str) -> list[float]:
    return [run.hit_rate for run in runs if run.variant == variant and run.config == config]


def report(runs: list[Run]) -> bool:
    verdicts: list[tuple[str, bool]] = []
    for variant in dict.fromkeys(run.variant for run in runs):
        table = Table(title=f"{variant}: fleet prefix-cache hit rate per run")
        for column in ("router", "mean", "runs", "spread", "answers", "errors", "decisions (last run)"):
            table.add_column(
                column, justify="left" if column in ("router", "decisions (last run)") else "right"
            )
        for config in dict.fromkeys(run.config for run in runs if run.variant == variant):
            mine = [run for run in runs if run.variant == variant and run.config == config]
            rates = [run.hit_rate for run in mine]
            shown = ", ".join(f"{rate:.1%}" for rate in rates)
            if variant == "restart":
                after = [run.after_restart_hit_rate for run in mine if run.after_restart_hit_rate is not None]
                shown += "; minute after restart: " + ", ".join(f"{rate:.1%}" for rate in after)
            table.add_row(
                config, f"{statistics.mean(rates):.1%}", shown, f"{max(rates) - min(rates):.1%}",
                str(sum(run.requests for run in mine)), str(sum(run.errors for run in mine)),
                ", ".join(f"{k} {v:.0f}" for k, v in sorted(mine[-1].decisions.items())),
            )  # fmt: skip
        console.print(table)
    one, two, prefix_two = (
        _rates(runs, "main", label) for label in ("kv_events x1", "kv_events x2", "prefix x2")
    )
    if one and two and prefix_two:
        verdicts.append((
            f"2 workers: kv_events {statistics.mean(two):.1%} >= 0.98x its 1 worker's "
            f"{statistics.mean(one):.1%}",
            statistics.mean(two) >= 0.98 * statistics.mean(one),
        ))  # fmt: skip
        verdicts.append((
            f"2 workers: kv_events' worst run {min(two):.1%} above prefix's best {max(prefix_two):.1%}",
            min(two) > max(prefix_two),
        ))  # fmt: skip
    cache_aware = _rates(runs, "main", "vllm-router cache_aware")
    if cache_aware and one:
        best = max(("kv_events x1", "kv_events x2", "prefix x1", "prefix x2"),
                   key=lambda label: statistics.mean(_rates(runs, "main", label) or [0.0]))  # fmt: skip
        ratio = statistics.mean(_rates(runs, "main", best)) / max(statistics.mean(cache_aware), 1e-9)
        console.print(f"kvtune's best ({best}) vs vllm-router cache_aware, hit rate: {ratio:.2f}x")
    return verdicts_passed(verdicts)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
