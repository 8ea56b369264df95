"""Capture round trip on real engines: chat traffic sent through `kvtune up`'s router with `--capture-trace`,
the capture merged and replayed on a fresh engine of the same pool, the engine's own hit rate the same within
2 points (and the curve of the captured trace predicting both); no prompt text anywhere in the capture.

The pool is small enough that blocks are evicted before their reuse, so the hit rate depends on which blocks
the capture says recur, in which order, and on each request's size: a capture that lost any of it would
replay a different hit rate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvtune import metrics
from kvtune.engine import Engine, free_port
from kvtune.loadgen.runner import LoadSpec, run_load
from kvtune.profile import EngineProfile
from kvtune.traces.analysis import trace_curve
from kvtune.traces.format import read_trace
from kvtune.traces.tokens import BlockMapping
from tests.helpers import ARTIFACTS, default_profile_data
from tests.helpers_up import running_up

pytestmark = pytest.mark.engine

MARKER = "KVTUNE-PLANTED-MARKER-5e1d"
BLOCK = 32
POOL = 28  # usable blocks: the traffic's curve reaches its ideal only from 39 (blocks evicted before reuse)
MAX_MODEL_LEN = 512
SYSTEM = [
    f"You are assistant {n} of the {MARKER} desk. Answer briefly and politely about trains and weather. " * 3
    for n in range(3)
]


def chat_log(path: Path, conversations: int = 16, turns: int = 3) -> int:
    """Multi-turn chats, interleaved: each turn resends its conversation so far after a shared system
    prompt."""
    lines = []
    for turn in range(turns):
        for conversation in range(conversations):
            if turn >= 1 + conversation % turns:
                continue
            messages = [{"role": "system", "content": SYSTEM[conversation % 3]}]
            for earlier in range(turn + 1):
                messages.append(
                    {"role": "user", "content": f"Conversation {conversation}, question {earlier}: {MARKER}?"}
                )
                if earlier < turn:
                    messages.append({"role": "assistant", "content": f"Answer {earlier} of {conversation}."})
            lines.append(json.dumps({"messages": messages, "max_tokens": 8}))
    path.write_text("".join(f"{line}\n" for line in lines))
    return len(lines)


def pool_profile_data(name: str) -> dict[str, object]:
    return default_profile_data(
        name=name,
        block_size=BLOCK,
        num_gpu_blocks_override=POOL + 1,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes="256MiB",
    )


def router_ready(client: httpx.Client, url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.get(url).status_code != 200:
        assert time.monotonic() < deadline, f"the router did not take its engine in within {timeout_s:g} s"
        time.sleep(0.5)


def hit_counters(url: str) -> tuple[float, float]:
    samples = metrics.parse(httpx.get(f"{url}/metrics", timeout=30).text)
    return metrics.total(samples, metrics.PREFIX_CACHE_HITS), metrics.total(
        samples, metrics.PREFIX_CACHE_QUERIES
    )


def test_captured_traffic_replays_to_the_same_hit_rate_and_holds_no_text(
    tmp_path: Path, model_path: str
) -> None:
    import yaml

    log = tmp_path / "chats.jsonl"
    sent = chat_log(log)
    profile_path = tmp_path / "engine.yaml"
    profile_path.write_text(yaml.safe_dump(pool_profile_data("capture-engine")))
    capture = tmp_path / "capture"
    router_port, control_port = free_port(), free_port()
    up_args = [
        str(profile_path), "--router", "round_robin", "--router-port", str(router_port),
        "--control-port", str(control_port), "--capture-trace", str(capture),
        "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    engine_url = f"http://127.0.0.1:{yaml.safe_load(profile_path.read_text())['port']}"
    with running_up(up_args, "trace-capture-up.log"), httpx.Client(timeout=120) as client:
        # The router takes an engine in once its own health check has seen it answer.
        router_ready(client, f"http://127.0.0.1:{router_port}/health")
        # The users' own traffic, one request at a time, streamed as chat clients do.
        for line in log.read_text().splitlines():
            body = json.loads(line) | {"model": "smollm2-135m", "stream": True}
            with client.stream(
                "POST", f"http://127.0.0.1:{router_port}/v1/chat/completions", json=body
            ) as answer:
                assert answer.status_code == 200
                assert any(chunk for chunk in answer.iter_bytes())
        hits, queries = hit_counters(engine_url)
    original = hits / queries

    merged = tmp_path / "captured.jsonl"
    subprocess.run(
        [sys.executable, "-m", "kvtune.cli", "trace", "merge", str(capture), "-o", str(merged)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    for path in [*capture.iterdir(), merged]:
        assert MARKER.encode() not in path.read_bytes(), path
        assert b"trains and weather" not in path.read_bytes(), path
    captured = read_trace(merged)
    assert captured.block_size == BLOCK and len(captured.requests) == sent
    # The engine counted the prompts the router counted, token for token.
    assert sum(r.input_length for r in captured.requests) == queries

    profile, _note = EngineProfile.model_validate(pool_profile_data("replay-engine")).adapted_to_host()
    ARTIFACTS.mkdir(exist_ok=True)
    with Engine(profile, ARTIFACTS / "trace-capture-replay.log", model_path=model_path) as engine:
        run_load(
            LoadSpec(
                url=engine.url,
                workload="trace",
                workload_args={"trace-file": str(merged)},
                arrival="closed",
                users=1,
            ),
            log_dir=tmp_path,
        )
        replay_hits, replay_queries = hit_counters(engine.url)
    replayed = replay_hits / replay_queries
    predicted = trace_curve(captured, BlockMapping(BLOCK, BLOCK, BLOCK, MAX_MODEL_LEN)).curve.hit_rate(POOL)
    shown = f"original {original:.4f}, replayed {replayed:.4f}, curve {predicted:.4f}"
    figures = {"original": original, "replayed": replayed, "predicted": predicted, "prompt_tokens": queries}
    (ARTIFACTS / "trace-capture-round-trip.json").write_text(json.dumps(figures, indent=2) + "\n")
    assert replay_queries == queries, shown
    # The pool mattered: evictions cost hits the infinite pool would have had.
    assert trace_curve(captured, BlockMapping(BLOCK, BLOCK, BLOCK)).curve.ideal_hit_rate > original + 0.02, (
        shown
    )
    assert abs(replayed - original) <= 0.02, shown
    assert abs(predicted - original) <= 0.02, shown
