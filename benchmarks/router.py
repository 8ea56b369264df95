"""Routing across two engines on one host: fleet prefix-cache hit rate, TTFT and throughput per policy.

One run, side by side, the same seeded workload each time, every fleet started cold:
- single: one engine on one core (it sees every prefix: the hit rate to keep);
- round_robin, prefix, kv_events: two engines, one core each, behind kvtune's router (`kvtune up` of one
  profile with replicas: 2).
The workload: several distinct long shared prefixes (system prompts, more of them than engines) and
multi-turn chats on them (each turn carries the conversation so far). The KV-pressure variants
(`--pressure`) cap each pool so prefixes are evicted, where what the engine reports (kv_events) and what
the router sent it (prefix) can part ways: `pressure` with the chats alone, `pressure-long` with two more
users asking for long answers to unshared prompts (blocks the router never sends fill the pools).
Targets: kv_events' hit rate >= 0.95x the single engine's, round_robin's clearly lower (under 0.9x);
under pressure, kv_events above prefix. Then the router's own added latency, against a fast local
upstream (benchmarks.router_overhead): under 2 ms at p99. Results go to results.json in the run's folder
as each fleet is measured.

    python -m benchmarks.router [--pressure] [--variants ample,pressure,pressure-long] [--sessions 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks import router_overhead
from kvtune import metrics, metrics_window
from kvtune.engine import free_port
from kvtune.loadgen.text import TextMaker, load_tokenizer
from kvtune.model_store import ensure_model
from kvtune.processes import stop_group

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
MODEL = "smollm2-135m"
console = Console(width=150)


@dataclass(frozen=True)
class Workload:
    prefixes: int
    prefix_tokens: int
    sessions: int
    turns: int
    question_tokens: int
    max_tokens: int
    concurrency: int
    seed: int
    writers: int = 0  # users sending unshared prompts with long answers, beside the chats
    writer_tokens: int = 0


@dataclass
class RunResult:
    name: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    requests: int
    errors: int
    reasons: dict[str, float]  # the router's decisions by reason


def engine_profile(pressure: bool) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(PROFILE.read_text())
    data |= {"enforce_eager": True, "max_model_len": 2048, "kv_cache_memory_bytes": "256MiB"}
    data.pop("cpu_reserved_cores", None)
    if pressure:
        data["num_gpu_blocks_override"] = 24  # 3,072 tokens: about three of the six prefixes with their chats
    return data


@contextlib.contextmanager
def fleet(name: str, pressure: bool, folder: Path) -> Iterator[tuple[str, list[str]]]:
    """`kvtune up` of the benchmark's engines: (the URL clients use: the router's or the single engine's,
    the engines' URLs)."""
    data = engine_profile(pressure) | {"name": name, "port": free_port()}
    router_port = None
    if name == "single":
        data["cpu_threads_bind"] = "0"
        args = ["--router", "none"]
    else:
        data |= {"replicas": 2, "kv_events_port": free_port()}
        router_port = free_port()
        args = ["--router", name, "--router-port", str(router_port)]
    with kvtune_up(name, data, args, folder, router_port) as engines:
        yield (engines[0] if router_port is None else f"http://127.0.0.1:{router_port}"), engines


@contextlib.contextmanager
def kvtune_up(
    name: str, data: dict[str, Any], args: list[str], folder: Path, router_port: int | None = None
) -> Iterator[list[str]]:
    """`kvtune up` of the profile DATA (replicas expanded) with ARGS, until its engines are ready (and seen
    ready through the router on ROUTER_PORT, when one runs); yields the engines' URLs."""
    engines = [f"http://127.0.0.1:{data['port'] + i}" for i in range(data.get("replicas", 1))]
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    control = free_port()
    log = folder / f"{name}-up.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtune.cli", "up", str(path), "--control-port", str(control),
         "--log-dir", str(folder / f"{name}-logs"), *args],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while True:
            with contextlib.suppress(httpx.HTTPError):
                states = [
                    e["state"] for e in httpx.get(f"http://127.0.0.1:{control}/engines", timeout=5).json()
                ]
                ready = len(states) == len(engines) and all(s == "ready" for s in states)
                if ready and router_port is not None:  # and through the router: its health checks see all
                    seen = httpx.get(f"http://127.0.0.1:{router_port}/health").json()["ready"]
                    ready = len(seen) == len(engines)
                if ready:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: engines did not start: {log.read_text()[-2000:]}")
            time.sleep(1.0)
        yield engines
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
        stop_group(proc, grace_s=5)


def conversations(workload: Workload, maker: TextMaker) -> list[tuple[str, list[str]]]:
    """(system prompt, the user turns) per session: sessions spread over the prefixes, seeded."""
    rng = random.Random(workload.seed)
    systems = [maker.text(workload.prefix_tokens, f"prefix-{i}") for i in range(workload.prefixes)]
    return [
        (systems[rng.randrange(workload.prefixes)],
         [maker.text(workload.question_tokens, f"q-{s}-{t}") for t in range(workload.turns)])
        for s in range(workload.sessions)
    ]  # fmt: skip


@dataclass(frozen=True)
class Clients:
    """How the chat users reach the fleet: FRONTS[i % len] is user i's address (the router, or an engine
    called directly); RETRIES: a turn whose connection failed (a router restarting) is sent again, after
    RETRY_PAUSE_S, at most this many times; ON_TURN hears the number of turns answered so far."""

    fronts: tuple[str, ...]
    retries: int = 0
    retry_pause_s: float = 0.25
    on_turn: Callable[[int], None] | None = None


async def run_sessions(
    front: str | Clients, workload: Workload, sessions: list[tuple[str, list[str]]], writer_prompts: list[str]
) -> tuple[list[float], int, float]:
    """Closed loop: `concurrency` users, each taking the next session and playing its turns in order, and
    `writers` users asking for long answers to unshared prompts until the chats are done (their KV blocks
    push prefixes out of an engine's pool without the router sending it any prefix)."""
    clients = front if isinstance(front, Clients) else Clients((front,))
    ttfts: list[float] = []
    errors = 0
    answered = 0
    queue: asyncio.Queue[tuple[int, tuple[str, list[str]]]] = asyncio.Queue()
    for item in enumerate(sessions):
        queue.put_nowait(item)
    chats_done = asyncio.Event()

    async def writer(client: httpx.AsyncClient, first: int) -> None:
        nonlocal errors
        for prompt in itertools.cycle(writer_prompts[first:] + writer_prompts[:first]):
            if chats_done.is_set():
                return
            body = {"model": MODEL, "prompt": prompt, "max_tokens": workload.writer_tokens,
                    "ignore_eos": True, "temperature": 0}  # fmt: skip
            try:
                (await client.post(f"{clients.fronts[0]}/v1/completions", json=body)).raise_for_status()
            except httpx.HTTPError:
                errors += 1

    async def turn(
        client: httpx.AsyncClient, url: str, body: dict[str, Any]
    ) -> tuple[float | None, str] | None:
        """(time to first token, the answer) of one streamed turn; None when it failed."""
        start, first, answer = time.perf_counter(), None, []
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                for choice in json.loads(line[5:]).get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        first = first or time.perf_counter()
                        answer.append(content)
        return (None if first is None else first - start), "".join(answer)

    async def user(client: httpx.AsyncClient, url: str) -> None:
        nonlocal errors, answered
        while not queue.empty():
            index, (system, turns) = queue.get_nowait()
            messages = [{"role": "system", "content": system}]
            for question in turns:
                messages.append({"role": "user", "content": question})
                body = {"model": MODEL, "messages": messages, "max_tokens": workload.max_tokens,
                        "temperature": 0, "stream": True, "user": f"session-{index}"}  # fmt: skip
                result = None
                for attempt in range(clients.retries + 1):
                    try:
                        result = await turn(client, url, body)
                        break
                    except httpx.TransportError:
                        if attempt == clients.retries:
                            break
                        await asyncio.sleep(clients.retry_pause_s)
                    except httpx.HTTPError:
                        break
                if result is None:
                    errors += 1
                    break
                ttft, answer = result
                if ttft is not None:
                    ttfts.append(ttft)
                messages.append({"role": "assistant", "content": answer})
                answered += 1
                if clients.on_turn is not None:
                    clients.on_turn(answered)

    async def chats(client: httpx.AsyncClient) -> None:
        fronts = clients.fronts
        await asyncio.gather(*(user(client, fronts[i % len(fronts)]) for i in range(workload.concurrency)))
        chats_done.set()

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        spread = len(writer_prompts) // max(workload.writers, 1)
        writers = [writer(client, i * spread) for i in range(workload.writers)]
        await asyncio.gather(chats(client), *writers)
    return ttfts, errors, time.perf_counter() - started


def scrape_all(engines: list[str]) -> list[list[metrics.Sample]]:
    return [metrics.scrape(url) for url in engines]


def fleet_hit_rate(before: list[list[metrics.Sample]], after: list[list[metrics.Sample]]) -> float:
    """The fleet's prefix-cache hit rate over the run: each engine's window read by the one window rule
    (a restarted engine counts from its restart), their hits over their queries (0 when none queried)."""
    windows = [
        metrics_window.from_snapshots(start, end, metrics_window.Peaks(), 0.0)
        for start, end in zip(before, after, strict=True)
    ]
    return metrics_window.fleet_hit_rate(windows) or 0.0


def decisions(router: str) -> dict[str, float]:
    """The router's decisions by reason (kvtune_router_requests_total)."""
    reasons: dict[str, float] = {}
    for sample in metrics.scrape(router):
        if sample.name == metrics.ROUTER_REQUESTS:
            reasons[sample.labels["reason"]] = reasons.get(sample.labels["reason"], 0.0) + sample.value
    return reasons


def measure(name: str, variant: Variant, sessions: list[tuple[str, list[str]]], writer_prompts: list[str],
            folder: Path) -> RunResult:  # fmt: skip
    console.print(f"[bold]{name}[/bold] ({variant.label}): starting engines")
    (folder / variant.key).mkdir(exist_ok=True)
    with fleet(name, variant.pressure, folder / variant.key) as (front, engines):
        before = scrape_all(engines)
        ttfts, errors, wall = asyncio.run(run_sessions(front, variant.workload, sessions, writer_prompts))
        after = scrape_all(engines)
        reasons = {} if name == "single" else decisions(front)
    if not ttfts:
        raise RuntimeError(f"{name} ({variant.key}): no request succeeded ({errors} errors), see {folder}")
    ttfts.sort()
    result = RunResult(
        name=name,
        hit_rate=fleet_hit_rate(before, after),
        ttft_p50_s=statistics.median(ttfts),
        ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        throughput_rps=len(ttfts) / wall,
        requests=len(ttfts),
        errors=errors,
        reasons=reasons,
    )
    console.print(f"  hit rate {result.hit_rate:.1%}, p50 TTFT {result.ttft_p50_s:.2f} s, "
                  f"{result.throughput_rps:.2f} req/s, {errors} errors"
                  + (f"; decisions {_reasons(reasons)}" if reasons else ""))  # fmt: skip
    return result


def _reasons(reasons: dict[str, float]) -> str:
    return ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(reasons.items()))


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    pressure: bool
    workload: Workload


def variants(workload: Workload) -> dict[str, Variant]:
    long = dataclasses.replace(workload, writers=2, writer_tokens=384)
    return {
        "ample": Variant("ample", "ample KV pools", False, workload),
        "pressure": Variant("pressure", "KV pressure: 24-block pools", True, workload),
        "pressure-long": Variant(
            "pressure-long", "KV pressure + 2 users writing 384-token answers to unshared prompts", True, long
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__.splitlines()[0])
    parser.add_argument("--pressure", action="store_true", help="the KV-pressure variants too")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--policies", default="single,round_robin,prefix,kv_events")
    parser.add_argument("--variants", help="comma-separated, of ample, pressure, pressure-long (default: "
                        "ample, or all three with --pressure)")  # fmt: skip
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args(argv)
    model_path = str(ensure_model(MODEL))
    maker = TextMaker(load_tokenizer(model_path))
    workload = Workload(prefixes=6, prefix_tokens=700, sessions=args.sessions, turns=3, question_tokens=40,
                        max_tokens=16, concurrency=4, seed=7)  # fmt: skip
    known = variants(workload)
    chosen = (args.variants or ("ample,pressure,pressure-long" if args.pressure else "ample")).split(",")
    unknown = [key for key in chosen if key not in known]
    if unknown:
        parser.error(f"--variants: {unknown[0]!r} is not one of {', '.join(known)}")
    sessions = conversations(workload, maker)
    writer_prompts = [maker.text(60, f"writer-{i}") for i in range(40)]
    names = args.policies.split(",")
    folder = Path(tempfile.mkdtemp(prefix="kvtune-router-bench-"))
    results: dict[str, list[RunResult]] = {}
    for key in chosen:
        results[key] = [measure(name, known[key], sessions, writer_prompts, folder) for name in names]
        save(folder, results, None)  # what is measured stays on disk, whatever comes next
    overhead = None if args.skip_overhead else router_overhead.measure(model_path)
    save(folder, results, overhead)
    passed = report({known[key]: runs for key, runs in results.items()}, overhead)
    console.print(f"results and logs in {folder}")
    return 0 if passed else 1


def save(folder: Path, results: dict[str, list[RunResult]], overhead: dict[str, float] | None) -> None:
    data = {"fleets": {key: [dataclasses.asdict(run) for run in runs] for key, runs in results.items()},
            "overhead": overhead}  # fmt: skip
    (folder / "results.json").write_text(json.dumps(data, indent=2))


def report(results: dict[Variant, list[RunResult]], overhead: dict[str, float] | None) -> bool:
    verdicts: list[tuple[str, bool]] = []
    for variant, runs in results.items():
        table = Table(title=variant.label)
        columns = (
            "fleet",
            "hit rate",
            "vs single",
            "p50 TTFT s",
            "p99 TTFT s",
            "req/s",
            "errors",
            "decisions",
        )
        for column in columns:
            table.add_column(column, justify="left" if column == "decisions" else "right")
        by_name = {run.name: run for run in runs}
        single = by_name.get("single")
        for run in runs:
            ratio = f"{run.hit_rate / single.hit_rate:.2f}x" if single and single.hit_rate else "-"
            table.add_row(run.name, f"{run.hit_rate:.1%}", ratio, f"{run.ttft_p50_s:.2f}",
                          f"{run.ttft_p99_s:.2f}", f"{run.throughput_rps:.2f}", str(run.errors),
                          _reasons(run.reasons))  # fmt: skip
        console.print(table)
        kv_events, prefix, round_robin = (
            by_name.get("kv_events"),
            by_name.get("prefix"),
            by_name.get("round_robin"),
        )
        if not variant.pressure and single and kv_events and round_robin:
            verdicts.append(
                ("kv_events hit rate >= 0.95x single", kv_events.hit_rate >= 0.95 * single.hit_rate)
            )
            verdicts.append(
                ("round_robin hit rate < 0.9x single", round_robin.hit_rate < 0.9 * single.hit_rate)
            )
        if variant.pressure and kv_events and prefix:
            verdicts.append(
                (f"{variant.key}: kv_events hit rate > prefix", kv_events.hit_rate > prefix.hit_rate)
            )
    if overhead is not None:
        console.print(
            "router overhead vs a fast local upstream (ms): "
            + ", ".join(f"{k} {v:.2f}" for k, v in overhead.items())
        )
        verdicts.append(("router adds < 2 ms at p99 (shared-prefix prompts)", overhead["added_p99_ms"] < 2.0))
    return verdicts_passed(verdicts)


def verdicts_passed(verdicts: list[tuple[str, bool]]) -> bool:
    """Print each verdict (PASS/FAIL and what it checks); whether all passed."""
    for label, ok in verdicts:
        console.print(f"{'PASS' if ok else 'FAIL'} {label}")
    return all(ok for _, ok in verdicts)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
