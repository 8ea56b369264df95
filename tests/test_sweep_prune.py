"""KV arithmetic prunes configs whose pool cannot hold the workload's concurrency."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtune import platform
from kvtune.profile import load_profile
from kvtune.sweep.prune import Demand, candidates, workload_demand
from kvtune.sweep.spec import SweepSpec

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "deploy" / "profiles" / "cpu-smollm2.yaml"


@pytest.fixture(autouse=True)
def avx512_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "host_cpu_flags", lambda: frozenset({"avx512f"}))


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


def test_workload_demand_from_sizes() -> None:
    assert workload_demand(spec()) == Demand(6000, 32 + 64, 16)
    shared = spec(name="shared_prefix", args={"system-tokens": 800, "user-tokens": 400})
    assert workload_demand(shared) == Demand(800, 400 + 64, 16)
    assert workload_demand(spec(name="replay", args={})) is None


def test_small_pool_without_prefix_caching_is_pruned_with_the_arithmetic() -> None:
    sweep = spec()
    base = load_profile(BASE)
    result = {(str(c.knobs["kv_cache_memory_bytes"]), c.knobs["enable_prefix_caching"]): c for c in
              candidates(sweep, base, sweep.grid())}  # fmt: skip
    # float32 weights, fp8 KV: 11,520 bytes/token -> 256 MiB holds 23,296 tokens, 1 GiB 93,184.
    pruned = result[("256MiB", False)].pruned
    assert pruned is not None
    assert pruned.startswith(
        "KV pool holds 23,296 tokens; 16 requests in flight need 97,536 (16 x 6,096 per request)"
    )
    assert result[("256MiB", True)].pruned is None  # 6,000 shared once + 16 x 96 = 7,536
    assert result[("1GiB", False)].pruned is not None  # 93,184 < 97,536: caching is what makes it fit
    assert result[("1GiB", True)].pruned is None
