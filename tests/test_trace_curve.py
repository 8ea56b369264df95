"""The hit-rate curve: hand-computed cases of vLLM's rules, the one-pass curve equal to a replay of the block
pool at every size, the decisions read from it, pools priced by hand, and `kvtune trace curve` as a user
runs it."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtune.traces.analysis import analyse, curve_requests, trace_curve
from kvtune.traces.curve import CurveRequest, hit_rate_curve, simulate
from kvtune.traces.format import Trace, write_trace
from kvtune.traces.sizing import PoolPricing
from kvtune.traces.synthetic import ChatTraceShape, chat_trace
from kvtune.traces.tokens import BlockMapping, engine_requests
from tests.helpers import REPO


def request(keys: str, prompt_tokens: int, output_tokens: int = 1, block_size: int = 4) -> CurveRequest:
    kv_tokens = prompt_tokens + output_tokens - 1
    return CurveRequest(tuple(keys), prompt_tokens, -(-kv_tokens // block_size), kv_tokens // block_size)


def test_the_last_token_of_a_prompt_is_never_a_hit() -> None:
    # Two whole blocks, sent three times: only the first block can hit (the second holds the last token).
    same = [request("ab", 8), request("ab", 8), request("ab", 8)]
    curve = hit_rate_curve(same, 4)
    assert curve.hit_tokens(2) == 8 and curve.hit_rate(2) == pytest.approx(8 / 24)
    assert simulate(same, 4, 2).hit_tokens == 8


def test_a_finished_request_is_evicted_from_its_tail() -> None:
    # A's three blocks, then one unrelated block, in a pool of three: the unrelated block evicts A's last
    # block, so A's first two still hit when it comes again. Freed head first, they would all be gone.
    trace = [request("xyz", 12), request("u", 4), request("xyz", 12)]
    curve = hit_rate_curve(trace, 4)
    assert curve.min_blocks == 3
    assert curve.hit_tokens(3) == 8  # two blocks: the third holds the prompt's last token
    assert simulate(trace, 4, 3).hit_tokens == 8


def test_a_partial_block_displaces_no_cached_block() -> None:
    # B's prompt ends in a partial block (5 tokens of 4-token blocks): it goes to the queue's front, so the
    # next request takes it first instead of evicting A's block.
    trace = [request("a", 4, 1), request("b", 5, 1), request("a", 5, 1)]
    curve = hit_rate_curve(trace, 4)
    assert curve.hit_tokens(3) == 4
    assert simulate(trace, 4, 3).hit_tokens == 4
    assert curve.hit_tokens(2) == 0  # B holds two blocks: in a pool of two, one is A's


def test_chained_blocks_hit_only_after_their_prefix() -> None:
    # "pq" after "p": q would be cached in a big pool, but p is gone in a small one, so q cannot hit there.
    trace = [request("pq", 9), request("rs", 9), request("pq", 9)]
    curve = hit_rate_curve(trace, 4)
    assert curve.hit_tokens(3) == 0 and curve.hit_tokens(6) == 8
    assert curve.ideal_hit_rate == pytest.approx(8 / 27)


@pytest.mark.parametrize("seed", range(25))
def test_the_one_pass_curve_is_the_block_pool_replayed_at_every_size(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([4, 8, 16])
    shape = ChatTraceShape(
        conversations=rng.randint(5, 30),
        system_prompts=rng.randint(1, 4),
        system_tokens=rng.randint(1, 50),
        turns=rng.randint(1, 5),
        user_tokens=rng.randint(1, 30),
        output_tokens=rng.randint(1, 20),
        block_size=block_size,
        seed=seed,
    )
    mapping = BlockMapping(block_size, block_size, block_size)
    requests = curve_requests(
        engine_requests(Trace(block_size, tuple(chat_trace(shape))), mapping)[0], mapping
    )
    curve = hit_rate_curve(requests, block_size)
    for pool in range(curve.min_blocks, curve.max_blocks + 2):
        assert curve.hit_tokens(pool) == simulate(requests, block_size, pool).hit_tokens, pool
    assert curve.hit_rate(curve.max_blocks) == pytest.approx(curve.ideal_hit_rate)


def test_requests_in_flight_pin_their_blocks() -> None:
    # With two requests running, the second cannot evict the first's blocks: in a pool that holds both, the
    # third request still finds the first's.
    trace = [request("ab", 9), request("cd", 9), request("ab", 9)]
    assert simulate(trace, 4, 6, in_flight=2).hit_tokens == 8
    with pytest.raises(ValueError, match="more than the pool's"):
        simulate(trace, 4, 2)


def chat(conversations: int = 60, block_size: int = 16) -> Trace:
    shape = ChatTraceShape(
        conversations=conversations, block_size=block_size, system_tokens=64, user_tokens=24
    )
    return Trace(block_size, tuple(chat_trace(shape)))


def test_the_decisions_read_from_a_curve() -> None:
    traced = trace_curve(chat(), BlockMapping(16, 16, 16))
    curve = traced.curve
    analysis = analyse(traced, PoolPricing(16, None, "unknown", None, None, None, 40, ""), in_flight=2)
    assert analysis.smallest_pool == max(r.total_blocks for r in traced.pool_requests)
    assert analysis.everything_pool == curve.max_blocks
    assert curve.hit_rate(analysis.target_pool) >= 0.95 * curve.ideal_hit_rate
    assert curve.hit_rate(analysis.target_pool - 1) < 0.95 * curve.ideal_hit_rate
    assert analysis.smallest_pool < analysis.knee_pool < analysis.everything_pool
    marked = {mark: row for row in analysis.rows for mark in row.marks}
    assert set(marked) == {"smallest", "knee", "target", "everything", "profile"}
    assert marked["profile"].cost.usable_blocks == 40
    assert marked["knee"].in_flight_hit_rate is not None
    sizes = [row.cost.usable_blocks for row in analysis.rows]
    assert sizes == sorted(sizes) and [row.hit_rate for row in analysis.rows] == sorted(
        r.hit_rate for r in analysis.rows
    )


def test_pools_priced_by_hand_for_a_gpu_profile() -> None:
    from kvtune.profile import load_profile
    from kvtune.traces.sizing import pricing

    prices = pricing(load_profile(REPO / "deploy" / "profiles" / "gpu-llama31-8b-h100.yaml"))
    # Llama 3.1 8B, fp8 KV: 2 x 32 layers x 8 KV heads x 128 x 1 byte = 65,536 bytes a token, blocks of 16.
    assert (prices.bytes_per_token, prices.block_size) == (65_536, 16)
    cost = prices.cost(1023)
    assert cost.num_gpu_blocks_override == 1024 and cost.tokens == 16_368
    assert cost.kv_cache_memory_bytes == 1024 * 16 * 65_536 == 2**30
    # (8,030,261,248 params x 2 bytes + 1 GiB) / 80 GiB
    assert cost.gpu_memory_utilization == pytest.approx((8_030_261_248 * 2 + 2**30) / (80 * 2**30))
    assert cost.fp8_bytes is None  # already fp8


# ---- the command -------------------------------------------------------------------------------------------


def kvtune(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtune.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    with path.open("w") as file:
        write_trace(file, chat(block_size=128).requests, 128)
    return path


def test_the_command_prints_writes_and_prices_a_profile(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "curve"
    result = kvtune(
        "trace", "curve", str(trace_file), "--profile", str(REPO / "deploy/profiles/cpu-smollm2.yaml"),
        "--out", str(out), "--pools", "7,50",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "ideal hit rate (an infinite pool):" in text and "knee:" in text
    assert "for the target pool set one of: num_gpu_blocks_override:" in text
    assert "the profile's pool:" in text
    data = json.loads((out / "curve.json").read_text())
    assert {7, 50} <= {row["cost"]["usable_blocks"] for row in data["rows"]}
    target = next(row for row in data["rows"] if "target" in row["marks"])
    per_token = data["bytes_per_token"]
    assert target["cost"]["kv_cache_memory_bytes"] == (target["cost"]["usable_blocks"] + 1) * 128 * per_token
    assert (out / "curve.svg").read_text().lstrip().startswith("<?xml")
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_the_command_as_json_without_a_profile(trace_file: Path) -> None:
    result = kvtune("trace", "curve", str(trace_file), "--block-size", "128", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["block_size"] == 128 and data["bytes_per_token"] is None
    assert 0 < data["ideal_hit_rate"] < 1


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "give --profile PROFILE (to price the pools) or --block-size N"),
        (
            ["--block-size", "32", "--tokens-per-block", "48"],
            "is not a multiple of the engine's block size 32",
        ),
        (["--block-size", "32", "--target", "1.5"], "argument --target: 1.5 is not a share"),
        (["--block-size", "32", "--sample", "0"], "argument --sample: 0 is not a finite number above 0"),
        (["--block-size", "32", "--pools", "x"], "argument --pools: 'x' is not a list of block counts"),
    ],
)
def test_bad_flags_exit_2_naming_the_fix(trace_file: Path, args: list[str], expected: str) -> None:
    result = kvtune("trace", "curve", str(trace_file), *args)
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert expected in output and "Traceback" not in output


def test_a_bad_trace_exits_2_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' * 2 + "{}\n"
    )
    result = kvtune("trace", "curve", str(path), "--block-size", "32")
    output = " ".join(result.stderr.split())
    assert result.returncode == 2 and f"{path}:3: missing timestamp" in output and "Traceback" not in output


def test_an_offload_tier_adds_the_curve_between_the_two_sizes() -> None:
    from kvtune.profile import load_profile
    from kvtune.traces.sizing import offload_blocks, pricing

    prices = pricing(load_profile(REPO / "deploy" / "profiles" / "gpu-llama31-8b-h100.yaml"))
    # 8 GiB across one rank, 16 tokens x 65,536 bytes a block: 8,192 blocks; split over TP 4 ranks a quarter.
    assert offload_blocks(8, prices, ranks=1) == 8 * 2**30 // (16 * 65_536) == 8192
    assert offload_blocks(8, prices, ranks=4) == 2048
    traced = trace_curve(chat(block_size=16), BlockMapping(16, 16, 16))
    small = PoolPricing(16, 65_536, "", None, None, None, traced.curve.min_blocks, "")
    tier = analyse(traced, small, offload_gib=0.01).offload
    assert tier is not None
    assert tier.blocks == int(0.01 * 2**30 // (16 * 65_536))
    assert tier.hit_rate_without == traced.curve.hit_rate(traced.curve.min_blocks)
    assert tier.hit_rate_with == traced.curve.hit_rate(traced.curve.min_blocks + tier.blocks)
    assert tier.hit_rate_with > tier.hit_rate_without
