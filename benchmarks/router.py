"""Routing across two engines on one host: fleet prefix-cache hit rate, TTFT and throughput per policy.

One run, side by side, the same seeded workload each time, every fleet started cold:
- single: one engine on one core (it sees every prefix: the hit rate to keep);
- round_robin, prefix, kv_events: two engines, one core each, behind kvtune's router (`kvtune up` of one
  profile with replicas: 2).
The workload: several distinct long shared prefixes (system prompts, more of them than engines) and
multi-turn chats on them (each turn carries the conversation so far). A KV-pressure variant (`--pressure`)
caps each pool so prefixes are evicted, where what the engine reports (kv_events) and what the router
sent it (prefix) part ways. Targets: kv_events' hit rate >= 0.95x the single engine's, round_robin's
clearly lower (under 0.9x); under pressure, kv_events above prefix. Then the router's own added latency,
against a fast local upstream (benchmarks.router_overhead): under 2 ms at p99.

    python -m benchmarks.router [--pressure] [--sessions 24]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from benchmarks import router_overhead
from kvtune import metrics
from kvtune.engine import free_port
from kvtune.loadgen.text import TextMaker, load_tokenizer
from kvtune.model_store import ensure_model
from kvtune.processes import stop_group

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
MODEL = "smollm2-135m"
console = Console()


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


@dataclass
class RunResult:
    name: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    requests: int
    errors: int


def engine_profile(pressure: bool) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(PROFILE.read_text())
    data |= {"enforce_eager": True, "max_model_len": 2048, "kv_cache_memory_bytes": "256MiB"}
    data.pop("cpu_reserved_cores", None)
    if pressure:
        data["num_gpu_blocks_override"] = 24  # 3,072 tokens: about three of the six prefixes with their chats
    return data


@contextlib.contextmanager
def fleet(name: str, pressure: bool, folder: Path) -> Iterator[tuple[str, list[str]]]:
    """`kvtune up` of the benchmark's engines: (the URL clients use, the engines' URLs)."""
    data = engine_profile(pressure) | {"name": name, "port": free_port()}
    args: list[str]
    if name == "single":
        data["cpu_threads_bind"] = "0"
        args = ["--router", "none"]
        engines = [f"http://127.0.0.1:{data['port']}"]
    else:
        data |= {"replicas": 2, "kv_events_port": free_port()}
        router_port = free_port()
        args = ["--router", name, "--router-port", str(router_port)]
        engines = [f"http://127.0.0.1:{data['port'] + i}" for i in range(2)]
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
                if len(states) == len(engines) and all(s == "ready" for s in states):
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: engines did not start: {log.read_text()[-2000:]}")
            time.sleep(1.0)
        front = engines[0] if name == "single" else f"http://127.0.0.1:{router_port}"
        yield front, engines
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


async def run_sessions(
    front: str, workload: Workload, sessions: list[tuple[str, list[str]]]
) -> tuple[list[float], int, float]:
    """Closed loop: `concurrency` users, each taking the next session and playing its turns in order."""
    ttfts: list[float] = []
    errors = 0
    queue: asyncio.Queue[tuple[int, tuple[str, list[str]]]] = asyncio.Queue()
    for item in enumerate(sessions):
        queue.put_nowait(item)

    async def user(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty():
            index, (system, turns) = queue.get_nowait()
            messages = [{"role": "system", "content": system}]
            for question in turns:
                messages.append({"role": "user", "content": question})
                body = {"model": MODEL, "messages": messages, "max_tokens": workload.max_tokens,
                        "temperature": 0, "stream": True, "user": f"session-{index}"}  # fmt: skip
                start, first, answer = time.perf_counter(), None, []
                try:
                    async with client.stream("POST", f"{front}/v1/chat/completions", json=body) as response:
                        if response.status_code != 200:
                            errors += 1
                            break
                        async for line in response.aiter_lines():
                            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                                continue
                            for choice in json.loads(line[5:]).get("choices") or []:
                                content = (choice.get("delta") or {}).get("content")
                                if content:
                                    first = first or time.perf_counter()
                                    answer.append(content)
                except httpx.HTTPError:
                    errors += 1
                    break
                if first is not None:
                    ttfts.append(first - start)
                messages.append({"role": "assistant", "content": "".join(answer)})

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(user(client) for _ in range(workload.concurrency)))
    return ttfts, errors, time.perf_counter() - started


def hit_counters(engines: list[str]) -> tuple[float, float]:
    samples = [metrics.scrape(url) for url in engines]
    return (sum(metrics.total(s, metrics.PREFIX_CACHE_HITS) for s in samples),
            sum(metrics.total(s, metrics.PREFIX_CACHE_QUERIES) for s in samples))  # fmt: skip


def measure(
    name: str, pressure: bool, workload: Workload, sessions: list[tuple[str, list[str]]], folder: Path
) -> RunResult:
    console.print(f"[bold]{name}[/bold]: starting engines{' (KV pressure)' if pressure else ''}")
    with fleet(name, pressure, folder) as (front, engines):
        hits0, queries0 = hit_counters(engines)
        ttfts, errors, wall = asyncio.run(run_sessions(front, workload, sessions))
        hits1, queries1 = hit_counters(engines)
    ttfts.sort()
    result = RunResult(
        name=name,
        hit_rate=(hits1 - hits0) / max(queries1 - queries0, 1.0),
        ttft_p50_s=statistics.median(ttfts),
        ttft_p99_s=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        throughput_rps=len(ttfts) / wall,
        requests=len(ttfts),
        errors=errors,
    )
    console.print(f"  hit rate {result.hit_rate:.1%}, p50 TTFT {result.ttft_p50_s:.2f} s, "
                  f"{result.throughput_rps:.2f} req/s, {errors} errors")  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__.splitlines()[0])
    parser.add_argument("--pressure", action="store_true", help="the KV-pressure variant too")
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--policies", default="single,round_robin,prefix,kv_events")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args(argv)
    model_path = str(ensure_model(MODEL))
    maker = TextMaker(load_tokenizer(model_path))
    workload = Workload(prefixes=6, prefix_tokens=700, sessions=args.sessions, turns=3, question_tokens=40,
                        max_tokens=16, concurrency=4, seed=7)  # fmt: skip
    sessions = conversations(workload, maker)
    names = args.policies.split(",")
    folder = Path(tempfile.mkdtemp(prefix="kvtune-router-bench-"))
    variants = [False, True] if args.pressure else [False]
    results = {
        pressure: [measure(name, pressure, workload, sessions, folder) for name in names]
        for pressure in variants
    }
    overhead = None if args.skip_overhead else router_overhead.measure(model_path)
    passed = report(results, overhead)
    console.print(f"logs in {folder}")
    return 0 if passed else 1


def report(results: dict[bool, list[RunResult]], overhead: dict[str, float] | None) -> bool:
    verdicts: list[tuple[str, bool]] = []
    for pressure, runs in results.items():
        table = Table(title="KV pressure (small pools)" if pressure else "Ample KV pools")
        for column in ("fleet", "hit rate", "vs single", "p50 TTFT s", "p99 TTFT s", "req/s", "errors"):
            table.add_column(column, justify="right")
        by_name = {run.name: run for run in runs}
        single = by_name.get("single")
        for run in runs:
            ratio = f"{run.hit_rate / single.hit_rate:.2f}x" if single and single.hit_rate else "-"
            table.add_row(run.name, f"{run.hit_rate:.1%}", ratio, f"{run.ttft_p50_s:.2f}",
                          f"{run.ttft_p99_s:.2f}", f"{run.throughput_rps:.2f}", str(run.errors))  # fmt: skip
        console.print(table)
        if not pressure and single and "kv_events" in by_name and "round_robin" in by_name:
            verdicts.append(
                (
                    "kv_events hit rate >= 0.95x single",
                    by_name["kv_events"].hit_rate >= 0.95 * single.hit_rate,
                )
            )
            verdicts.append(
                (
                    "round_robin hit rate < 0.9x single",
                    by_name["round_robin"].hit_rate < 0.9 * single.hit_rate,
                )
            )
        if pressure and "kv_events" in by_name and "prefix" in by_name:
            verdicts.append(
                (
                    "pressure: kv_events hit rate > prefix",
                    by_name["kv_events"].hit_rate > by_name["prefix"].hit_rate,
                )
            )
    if overhead is not None:
        console.print(
            "router overhead vs a fast local upstream: "
            + ", ".join(f"{k} {v:.2f}" for k, v in overhead.items())
        )
        verdicts.append(("router adds < 2 ms at p99 (shared-prefix prompts)", overhead["added_p99_ms"] < 2.0))
    for label, ok in verdicts:
        console.print(f"{'PASS' if ok else 'FAIL'} {label}")
    return all(ok for _, ok in verdicts)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
