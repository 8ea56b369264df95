"""`kvtune trace curve TRACE --profile PROFILE`: the prefix-cache hit rate of every pool size for a traffic,
and what each pool costs the profile's engine, before any engine starts.

Prints a table (and with --out writes curve.json, curve.svg and curve.png): the ideal hit rate, the knee,
the smallest pool reaching a share of the ideal, the profile's own pool, each priced in blocks, tokens,
bytes per GPU and the profile settings that give it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvtune import kv_math
from kvtune.commands.common import ExitCode, count, positive_count, positive_number, seconds
from kvtune.config_errors import ConfigError
from kvtune.files import ensure_writable_folder, write_atomic
from kvtune.profile import EngineProfile, load_profile
from kvtune.traces.analysis import DEFAULT_TARGET_SHARE, CurveAnalysis, analyse, trace_curve
from kvtune.traces.format import read_trace
from kvtune.traces.plot import write_curve_plots
from kvtune.traces.sizing import PoolCost, PoolPricing, pricing
from kvtune.traces.tokens import BlockMapping
from kvtune.traces.window import TraceWindow


def _share(text: str) -> float:
    value = positive_number(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text[:40]} is not a share; give one above 0 and at most 1")
    return value


def _pools(text: str) -> tuple[int, ...]:
    try:
        pools = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r} is not a list of block counts, e.g. 64,128"
        ) from None
    if not pools or min(pools) < 1:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: give block counts of 1 or more, e.g. 64,128")
    return pools


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace", type=Path, metavar="TRACE", help="hash-block trace (JSONL, Mooncake's fields)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="engine profile: its block size, max_model_len and KV bytes price the pools",
    )
    parser.add_argument(
        "--block-size",
        type=positive_count,
        help="the engine's block size, without a profile (with one: its own)",
    )
    parser.add_argument(
        "--trace-block-size",
        type=positive_count,
        help="tokens per hash id in the trace (default: the lines' own block_size, else 512 as Mooncake's)",
    )
    parser.add_argument(
        "--tokens-per-block",
        type=positive_count,
        help="engine tokens each trace block becomes, a multiple of the block size "
        "(default: one engine block)",
    )
    parser.add_argument("--output-scale", type=positive_number, help="output tokens per trace output token")
    window = parser.add_argument_group("the part of the trace")
    window.add_argument("--start", type=count, default=0, help="first request (index, default 0)")
    window.add_argument("--count", type=positive_count, help="at most this many requests")
    window.add_argument("--duration", type=seconds, help="only requests within this many trace seconds")
    window.add_argument(
        "--sample", type=_share, default=1.0, help="share of whole conversations kept (default 1)"
    )
    window.add_argument("--seed", type=int, default=0, help="the sample's seed")
    parser.add_argument(
        "--target",
        type=_share,
        default=DEFAULT_TARGET_SHARE,
        help="the recommended pool reaches this share of the ideal hit rate (default %(default)s)",
    )
    parser.add_argument(
        "--in-flight",
        type=positive_count,
        default=1,
        help="requests running at once: the marked pools are also replayed through vLLM's block pool with "
        "this many in flight (default 1)",
    )
    parser.add_argument(
        "--pools", type=_pools, default=(), help="more pool sizes to show, usable blocks: 64,128"
    )
    parser.add_argument(
        "--offload-gib",
        type=positive_number,
        help="size a host-memory KV tier (vLLM's --kv-offloading-size, GiB across TP ranks) behind the pool "
        "(default: the profile's kv_offloading_size)",
    )
    parser.add_argument("--out", type=Path, help="folder for curve.json, curve.svg and curve.png")
    parser.add_argument("--json", action="store_true", help="print the analysis as JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    profile = _profile(args)
    if profile is None and args.block_size is None:
        raise ConfigError("trace curve: give --profile PROFILE (to price the pools) or --block-size N")
    if args.out is not None:
        ensure_writable_folder(args.out, "--out")
    block_size = profile.effective_block_size if profile else args.block_size
    trace = read_trace(args.trace, args.trace_block_size)
    mapping = BlockMapping(
        trace.block_size,
        args.tokens_per_block or block_size,
        block_size,
        profile.max_model_len if profile else None,
        args.output_scale,
    )
    window = TraceWindow(args.start, args.count, args.duration, args.sample, seed=args.seed)
    traced = trace_curve(trace, mapping, window)
    prices = (
        pricing(profile)
        if profile
        else PoolPricing(block_size, None, "no profile given", None, None, None, None, "")
    )
    ranks = profile.tensor_parallel_size if profile else 1
    analysis = analyse(
        traced,
        prices,
        target_share=args.target,
        in_flight=args.in_flight,
        extra_pools=args.pools,
        offload_gib=args.offload_gib or (profile.kv_offloading_size if profile else None),
        ranks=ranks,
    )
    if args.out is not None:
        write_atomic(args.out / "curve.json", json.dumps(analysis.to_json(), indent=2) + "\n")
        write_curve_plots(args.out, traced.curve, analysis)
    if args.json:
        sys.stdout.write(json.dumps(analysis.to_json(), indent=2) + "\n")
    else:
        _print(analysis, profile)
        if args.out is not None:
            Console().print(f"wrote {args.out}/curve.json, curve.svg, curve.png")
    return ExitCode.OK


def _profile(args: argparse.Namespace) -> EngineProfile | None:
    if args.profile is None:
        return None
    profile, _note = load_profile(args.profile).adapted_to_host()
    if args.block_size is not None and args.block_size != profile.effective_block_size:
        raise ConfigError(
            f"--block-size {args.block_size} disagrees with the profile's block size "
            f"{profile.effective_block_size}; drop --block-size or set block_size in the profile"
        )
    return profile


def _print(analysis: CurveAnalysis, profile: EngineProfile | None) -> None:
    console = Console()
    table = Table(
        title=f"prefix-cache hit rate by pool size: {analysis.requests:,} requests, "
        f"{analysis.prompt_tokens:,} prompt tokens, blocks of {analysis.block_size}"
    )
    on_gpu = any(row.cost.gpu_memory_utilization is not None for row in analysis.rows)
    for column in ("blocks", "tokens", "hit rate", "prefill/req"):
        table.add_column(column, justify="right")
    if analysis.in_flight > 1:
        table.add_column(f"{analysis.in_flight} in flight", justify="right")
    table.add_column("KV bytes" + (" per GPU" if analysis.per_gpu else ""), justify="right")
    if on_gpu:
        table.add_column("gpu util", justify="right")
    table.add_column("", justify="left")
    for row in analysis.rows:
        cost = row.cost
        cells = [
            f"{cost.usable_blocks:,}",
            f"{cost.tokens:,}",
            f"{row.hit_rate:.1%}",
            f"{row.computed_per_request:,.0f}",
        ]
        if analysis.in_flight > 1:
            cells.append("" if row.in_flight_hit_rate is None else f"{row.in_flight_hit_rate:.1%}")
        memory = cost.kv_cache_memory_bytes
        cells.append("" if memory is None else kv_math.format_bytes(memory))
        if on_gpu:
            utilization = cost.gpu_memory_utilization
            cells.append("" if utilization is None else f">= {utilization:.3f}")
        cells.append(", ".join(row.marks))
        table.add_row(*cells)
    console.print(table)
    lines = [
        f"ideal hit rate (an infinite pool): {analysis.ideal_hit_rate:.1%}; the smallest pool that serves "
        f"the largest request: {analysis.smallest_pool:,} blocks; every hit at {analysis.everything_pool:,}",
        f"knee: {analysis.knee_pool:,} blocks ({_rate(analysis, analysis.knee_pool)}); "
        f"{analysis.target_share:.0%} of the ideal from {analysis.target_pool:,} blocks "
        f"({_rate(analysis, analysis.target_pool)})",
        f"KV bytes per token: {analysis.bytes_how}",
        f"each trace block of {analysis.trace_block_size} tokens is {analysis.tokens_per_block} engine "
        "tokens (--tokens-per-block)",
    ]
    target = analysis.row_for(analysis.target_pool)
    if target is not None:
        lines.append("for the target pool set one of: " + _settings(target.cost, profile))
    if analysis.profile_pool is not None:
        lines.append(
            f"the profile's pool: {analysis.profile_pool:,} blocks ({_rate(analysis, analysis.profile_pool)})"
        )
    if analysis.cuts.requests:
        lines.append(
            f"{analysis.cuts.requests:,} requests cut to fit max_model_len: "
            f"{analysis.cuts.prompt_tokens:,} prompt and {analysis.cuts.output_tokens:,} output tokens"
        )
    if analysis.offload is not None:
        tier = analysis.offload
        lines.append(
            f"offload tier of {tier.gib:g} GiB: {tier.blocks:,} more blocks behind {tier.pool_blocks:,}; "
            f"hit rate {tier.hit_rate_without:.1%} -> {tier.hit_rate_with:.1%} (if the tier keeps what the "
            "pool evicts)"
        )
    lines.extend(analysis.notes)
    for line in lines:
        console.print(line, highlight=False)


def _rate(analysis: CurveAnalysis, pool: int) -> str:
    row = analysis.row_for(pool)
    return "" if row is None else f"hit rate {row.hit_rate:.1%}"


def _settings(cost: PoolCost, profile: EngineProfile | None) -> str:
    parts = [f"num_gpu_blocks_override: {cost.num_gpu_blocks_override}"]
    if cost.kv_cache_memory_bytes is not None:
        parts.append(f"kv_cache_memory_bytes: {cost.kv_cache_memory_bytes}")
    if cost.gpu_memory_utilization is not None:
        parts.append(f"gpu_memory_utilization: {min(cost.gpu_memory_utilization, 1.0):.3f} or more")
    if cost.fp8_bytes is not None and profile is not None and profile.device == "cuda":
        parts.append(f"(with kv_cache_dtype fp8: {kv_math.format_bytes(cost.fp8_bytes)})")
    return "; ".join(parts)
