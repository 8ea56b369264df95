"""The hit-rate curve against the engine: a multi-turn chat trace replayed on real vLLM engines at several
pool sizes spanning the knee, the curve's predicted hit rate beside the engine's own
`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`.

Each pool is a fresh engine (`num_gpu_blocks_override` = the pool + vLLM's null block, blocks of 32 tokens,
one trace block per engine block) sent the whole trace through `kvtune load`'s trace workload: one request at
a time in trace order, which is what the one-pass curve predicts, and with requests in flight at one pool,
which the block-pool replay predicts (three replays on the same engine, its cache reset between them; running
requests holding their blocks, finishing in the order they started). The pool the curve recommends (the
smallest reaching 95% of the ideal hit rate) is among the sizes, so its prediction is checked applied.
Target: every prediction within 2 points of the engine.

Run: `make bench-trace` (`python -m benchmarks.trace_curve`); about 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvtune import metrics
from kvtune.engine import Engine
from kvtune.files import write_atomic
from kvtune.loadgen.runner import LoadSpec, run_load
from kvtune.model_store import ensure_model
from kvtune.profile import EngineProfile, load_profile
from kvtune.sweep.trial import DEV_MODE_ENV, reset_prefix_cache
from kvtune.traces.analysis import TraceCurve, trace_curve
from kvtune.traces.curve import simulate
from kvtune.traces.format import Trace, write_trace
from kvtune.traces.synthetic import ChatTraceShape, chat_trace
from kvtune.traces.tokens import BlockMapping

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
BLOCK_SIZE = 32
# Prompts stay short (a 64-token system prompt, 32-token turns, 8-token answers, at most 224 tokens) so a CPU
# engine replays a few hundred requests in minutes; what decides the hit rate is which blocks recur, not how
# long they are. A pool of 8 blocks still holds one max_model_len sequence.
MAX_MODEL_LEN = 256
TARGET_POINTS = 2.0
console = Console()


def bench_shape(conversations: int, seed: int = 0, output_tokens: int = 8) -> ChatTraceShape:
    return ChatTraceShape(
        conversations=conversations,
        system_prompts=3,
        system_tokens=64,
        turns=4,
        user_tokens=32,
        output_tokens=output_tokens,
        block_size=BLOCK_SIZE,
        seed=seed,
    )


def write_chat_trace(path: Path, shape: ChatTraceShape) -> Trace:
    requests = chat_trace(shape)
    with path.open("w") as file:
        write_trace(file, requests, shape.block_size)
    return Trace(shape.block_size, tuple(requests), str(path))


def pool_profile(pool_blocks: int, name: str) -> EngineProfile:
    """The shipped CPU profile, eager, with a pool of POOL_BLOCKS usable blocks of 32 tokens."""
    from kvtune.engine import free_port

    data = load_profile(PROFILE).model_dump(mode="json", exclude_none=True)
    data.update(
        name=name,
        port=free_port(),
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=pool_blocks + 1,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes="256MiB",
    )
    profile, _note = EngineProfile.model_validate(data).adapted_to_host()
    return profile


@dataclass(frozen=True)
class PoolResult:
    pool_blocks: int
    in_flight: int
    predicted: float
    engine: float
    hits: float
    queries: float
    expected_queries: int
    preemptions: float
    replay_s: float

    @property
    def error_points(self) -> float:
        return 100 * (self.predicted - self.engine)


def measure_pool(
    trace_path: Path,
    traced: TraceCurve,
    pool_blocks: int,
    in_flight: tuple[int, ...],
    log_dir: Path,
    model_path: str,
) -> list[PoolResult]:
    """Replay the trace on a fresh engine of POOL_BLOCKS usable blocks once per IN_FLIGHT setting, the prefix
    cache reset between replays, and read the engine's own counters around each."""
    profile = pool_profile(pool_blocks, f"trace-pool-{pool_blocks}")
    results = []
    log = log_dir / f"engine-{pool_blocks}.log"
    with (
        Engine(profile, log, model_path=model_path, extra_env=DEV_MODE_ENV) as engine,
        httpx.Client(timeout=60) as client,
    ):
        for users in in_flight:
            reset_prefix_cache(client, engine.url)
            before = _counters(client, engine.url)
            started = time.monotonic()
            run_load(
                LoadSpec(
                    url=engine.url,
                    workload="trace",
                    workload_args={"trace-file": str(trace_path), "tokens-per-block": BLOCK_SIZE},
                    arrival="closed",
                    users=users,
                ),
                log_dir=log_dir,
            )
            replay_s = time.monotonic() - started
            after = _counters(client, engine.url)
            hits, queries, preemptions = (b - a for a, b in zip(before, after, strict=True))
            predicted = (
                traced.curve.hit_rate(pool_blocks)
                if users == 1
                else simulate(traced.pool_requests, BLOCK_SIZE, pool_blocks, users).hit_rate
            )
            results.append(
                PoolResult(
                    pool_blocks,
                    users,
                    predicted,
                    hits / queries if queries else 0.0,
                    hits,
                    queries,
                    traced.curve.prompt_tokens,
                    preemptions,
                    replay_s,
                )
            )
    return results


def _counters(client: httpx.Client, url: str) -> tuple[float, float, float]:
    samples = metrics.parse(client.get(f"{url}/metrics").text)
    names = (metrics.PREFIX_CACHE_HITS, metrics.PREFIX_CACHE_QUERIES, metrics.PREEMPTIONS)
    return tuple(metrics.total(samples, name) for name in names)  # type: ignore[return-value]


def pools_spanning_the_knee(traced: TraceCurve) -> list[int]:
    """Four pools or more: near the smallest, below the knee, the knee, the curve's recommendation."""
    curve = traced.curve
    knee, target = curve.knee(), curve.smallest_pool_reaching(0.95)
    low = max(curve.min_blocks + 2, (curve.min_blocks + knee) // 2)
    return sorted({curve.min_blocks + 1, low, knee, target})


def table(results: list[PoolResult]) -> Table:
    out = Table(title="prefix-cache hit rate: curve vs engine")
    for column in (
        "pool blocks",
        "in flight",
        "predicted",
        "engine",
        "error (points)",
        "preemptions",
        "replay s",
    ):
        out.add_column(column, justify="right")
    for r in results:
        out.add_row(
            f"{r.pool_blocks:,}",
            str(r.in_flight),
            f"{r.predicted:.4f}",
            f"{r.engine:.4f}",
            f"{r.error_points:+.2f}",
            f"{r.preemptions:.0f}",
            f"{r.replay_s:.0f}",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_curve", description=__doc__)
    parser.add_argument("--conversations", type=int, default=120)
    parser.add_argument(
        "--repeats", type=int, default=3, help="replays with requests in flight at the knee (their spread)"
    )
    parser.add_argument("--in-flight", type=int, default=4, help="requests in flight for the concurrent row")
    parser.add_argument("--out", type=Path, default=REPO / "test-artifacts" / "bench-trace")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / "chat-trace.jsonl"
    trace = write_chat_trace(trace_path, bench_shape(args.conversations))
    traced = trace_curve(trace, BlockMapping(BLOCK_SIZE, BLOCK_SIZE, BLOCK_SIZE, MAX_MODEL_LEN))
    curve = traced.curve
    pools = pools_spanning_the_knee(traced)
    console.print(
        f"{curve.requests} requests, {curve.prompt_tokens:,} prompt tokens; smallest pool "
        f"{curve.min_blocks}, knee {curve.knee()}, 95% of ideal at {curve.smallest_pool_reaching(0.95)}, "
        f"every hit at {curve.max_blocks}; ideal hit rate {curve.ideal_hit_rate:.4f}; pools {pools}"
    )
    model_path = str(ensure_model("smollm2-135m"))
    results: list[PoolResult] = []
    for pool in pools:
        in_flight = (1, *[args.in_flight] * args.repeats) if pool == curve.knee() else (1,)
        results.extend(measure_pool(trace_path, traced, pool, in_flight, args.out, model_path))
        console.print(table(results))
    write_atomic(args.out / "results.json", json.dumps([asdict(r) for r in results], indent=2) + "\n")
    sequential = [r for r in results if r.in_flight == 1]
    missed = [r for r in sequential if abs(r.error_points) > TARGET_POINTS or r.queries != r.expected_queries]
    if missed:
        console.print(
            f"[red]missed: {len(missed)} pool(s) beyond {TARGET_POINTS} points or with other traffic"
        )
        return 1
    console.print(f"every one-at-a-time prediction within {TARGET_POINTS} points of the engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
