"""KV arithmetic prunes configs whose pool cannot hold the workload's concurrency."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtune.loadgen.workload_args import WORKLOAD_ARGS, WorkloadArg
from kvtune.profile import load_profile
from kvtune.sweep.prune import Demand, candidates, workload_demand
from kvtune.sweep.spec import SweepSpec

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"


pytestmark = pytest.mark.usefixtures("fake_host")  # an AVX-512 host: fp8 KV is kept


def spec(**workload: object) -> SweepSpec:
    return SweepSpec.model_validate(
        {
            "name": "t",
            "base_profile": str(BASE),
            "space": {"kv_cache_memory_bytes": ["256MiB", "1GiB"], "enable_prefix_caching": [True, False]},
            "workload": {"name": "long_doc_qa", "args": {"num-docs": 2, "doc-tokens": 3000}, "users": 16}
            | workload,
            "slo": {"ttft_p99_s": 2.0},
        }
    )


def test_demand_counts_the_shared_prefix_once_with_caching() -> None:
    demand = Demand(shared_tokens=1000, per_request_tokens=100, concurrency=10)
    assert demand.tokens(prefix_caching=True) == 1000 + 10 * 100
    assert demand.tokens(prefix_caching=False) == 10 * 1100


def test_demand_in_whole_blocks() -> None:
    demand = Demand(shared_tokens=1000, per_request_tokens=100, concurrency=10)
    # Blocks of 128: 7 whole shared blocks (896 tokens) are cached once; each request needs 9 blocks
    # (1,100 tokens -> 1,152), 2 of them its own.
    assert demand.tokens(prefix_caching=True, block=128) == 896 + 10 * (1152 - 896)
    assert demand.tokens(prefix_caching=False, block=128) == 10 * 1152


def test_workload_demand_from_sizes(tmp_path: Path) -> None:
    assert workload_demand(spec()) == Demand(6000, 32 + 64, 16)
    shared = spec(name="shared_prefix", args={"system-tokens": 800, "user-tokens": 400})
    assert workload_demand(shared) == Demand(800, 400 + 64, 16)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert workload_demand(spec(name="replay", args={"replay-file": str(prompts)})) is None


def test_workload_demand_reads_defaults_from_the_workload_definitions() -> None:
    # No sizes given: the workloads' declared defaults (800 + 400 system/user, 2 x 3,000-token docs + 32).
    assert workload_demand(spec(name="shared_prefix", args={})) == Demand(800, 400 + 64, 16)
    assert workload_demand(spec(name="long_doc_qa", args={})) == Demand(6000, 32 + 64, 16)
    assert workload_demand(spec(name="multi_turn", args={}, max_tokens=16)) == Demand(0, 4 * (200 + 16), 16)
    reuse = spec(name="shared_prefix", args={"prefix-reuse": 0.25})
    assert workload_demand(reuse) == Demand(300, 1200 - 300 + 64, 16)


def test_a_changed_definition_changes_the_pruning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruning has no sizes of its own: a new default in the definitions is what it counts."""
    bigger = tuple(
        WorkloadArg(a.flag, a.kind, 5000, a.help, minimum=1) if a.flag == "doc-tokens" else a
        for a in WORKLOAD_ARGS["long_doc_qa"]
    )
    monkeypatch.setitem(WORKLOAD_ARGS, "long_doc_qa", bigger)
    assert workload_demand(spec(args={})) == Demand(10_000, 32 + 64, 16)


def test_small_pool_without_prefix_caching_is_pruned_with_the_arithmetic() -> None:
    sweep = spec()
    base = load_profile(BASE)
    result = {(str(c.knobs["kv_cache_memory_bytes"]), c.knobs["enable_prefix_caching"]): c for c in
              candidates(sweep, base, sweep.grid())}  # fmt: skip
    # float32 weights, fp8 KV: 11,520 bytes/token -> 256 MiB holds 23,296 tokens, 1 GiB 93,184.
    pruned = result[("256MiB", False)].pruned
    assert pruned is not None
    assert pruned.startswith(
        "KV pool has 23,168 usable tokens; 16 requests running need 98,304 "
        "(16 x 6,144 per request, in blocks of 128)"
    )
    assert result[("256MiB", True)].pruned is None  # 5,888 shared blocks once + 16 x 256 = 9,984
    assert result[("1GiB", False)].pruned is not None  # 93,184 < 98,304: caching is what makes it fit
    assert result[("1GiB", True)].pruned is None


def test_max_num_seqs_caps_the_requests_holding_kv() -> None:
    sweep = spec()
    base = load_profile(BASE)
    knobs = {"kv_cache_memory_bytes": "256MiB", "enable_prefix_caching": False}
    assert candidates(sweep, base, [knobs])[0].pruned is not None
    # 3 running x 6,144 = 18,432 tokens fit in 23,296: the other requests wait without holding KV.
    assert candidates(sweep, base, [knobs | {"max_num_seqs": 3}])[0].pruned is None
    assert candidates(sweep, base, [knobs | {"max_num_seqs": 4}])[0].pruned is not None
