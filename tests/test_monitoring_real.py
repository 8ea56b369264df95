"""Monitoring on a real engine: `kvtune up --prometheus`, a load test under KV pressure, and then every
dashboard query and alert rule evaluated by the real Prometheus; `kvtune doctor` on the same engine.

The engine's pool is made too small for its load on purpose: 14 KV blocks of 32 tokens (13 usable) under
max_model_len 384. Each request is a 200-token shared system prompt (6 shared blocks), a 50-token user turn
and a 64-token answer: 4 blocks of its own by the end, so two requests in flight need 14 blocks and six
closed-loop users preempt one another however fast the host is (the same arithmetic as test_sweep_real).
What is asserted is what that arithmetic decides (preemptions, a nearly full pool, both alerts pending or
firing, the doctor's advice) and what the shared prefix decides (a hit rate above 0.5), not latencies. The
engine follows every block's residency (kv_cache_metrics), so the residency queries read real evictions.
The offload tier's series come only from vLLM's CUDA builds: tests/test_dashboards.py evaluates those
queries with promtool on synthetic series instead.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvtune import metrics
from kvtune.engine import free_port, port_in_use
from kvtune.observability import alerts, dashboards, promql
from kvtune.observability.promql import EVERYTHING, FLEET
from kvtune.processes import group_members, stop_group
from tests.helpers import ARTIFACTS, default_profile_data
from tests.helpers_up import running_up

pytestmark = pytest.mark.engine

PRESSURED = {
    "name": "pressured",
    "max_model_len": 384,
    "block_size": 32,
    "enable_chunked_prefill": False,
    "max_num_batched_tokens": 1024,
    "num_gpu_blocks_override": 14,
    "kv_cache_metrics": True,
    "kv_cache_metrics_sample": 1.0,
}
LOAD_ARGS = ["--workload", "shared_prefix", "--arg", "system-tokens=200", "--arg", "user-tokens=50",
             "--users", "6", "--max-tokens", "64", "--warmup", "2"]  # fmt: skip
LOAD_SECONDS = 50
DOCTOR_WINDOW_S = 20
SCRAPE_INTERVAL_S = 1
# One prompt sent again and again: all but its last block comes from the prefix cache.
WARM_PROMPT = "Name the capital of each country in the European Union, one per line. " * 16
METRIC_NAME = re.compile(r"vllm:[a-z0-9_:]+")


@dataclass(frozen=True)
class Monitored:
    engine_url: str
    prometheus_url: str
    up: subprocess.Popen[bytes]
    log: Path


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvtune.cli", *args]


def prometheus_query(url: str, expr: str, at: float | None = None) -> dict[str, Any]:
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    response = httpx.get(f"{url}/api/v1/query", params=params, timeout=30)
    body: dict[str, Any] = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    data: dict[str, Any] = body["data"]
    return data


def values(data: dict[str, Any]) -> list[float]:
    assert data["resultType"] == "vector", data
    return [float(series["value"][1]) for series in data["result"]]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitored]:
    folder = tmp_path_factory.mktemp("monitored")
    profile = folder / "pressured.yaml"
    profile.write_text(yaml.safe_dump(default_profile_data(**PRESSURED)))
    control_port, prometheus_port = free_port(), free_port()
    args = [str(profile), "--log-dir", str(folder / "logs"), "--control-port", str(control_port),
            "--prometheus", "--prometheus-port", str(prometheus_port),
            "--scrape-interval", str(SCRAPE_INTERVAL_S)]  # fmt: skip
    engine_url = f"http://127.0.0.1:{yaml.safe_load(profile.read_text())['port']}"
    with running_up(args, "monitoring-up.log") as up:
        yield Monitored(
            engine_url, f"http://127.0.0.1:{prometheus_port}", up, ARTIFACTS / "monitoring-up.log"
        )


def exported_names(engine_url: str) -> set[str]:
    return {sample.name for sample in metrics.scrape(engine_url)}


def named_metrics(expr: str) -> set[str]:
    return set(METRIC_NAME.findall(expr))


def test_prometheus_dashboards_alerts_and_doctor_on_a_pressured_engine(
    monitored: Monitored, tmp_path: Path
) -> None:
    engine, prom = monitored.engine_url, monitored.prometheus_url
    # `kvtune up --prometheus` scrapes the engine and loaded the rules.
    deadline = time.monotonic() + 60
    while values(prometheus_query(prom, 'up{job="kvtune"}')) != [1.0]:
        assert time.monotonic() < deadline, "Prometheus never scraped the engine"
        time.sleep(1)
    rules = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = {rule["name"] for group in rules for rule in group["rules"]}
    assert loaded == {name for name, _ in alerts.alert_expressions()}

    # A closed-loop load test under KV pressure; the doctor watches part of it.
    load_log = ARTIFACTS / "monitoring-load.log"
    load = subprocess.Popen(
        cli("load", "--url", engine, *LOAD_ARGS, "--duration", str(LOAD_SECONDS)),
        stdout=load_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        # The doctor watches once preemptions have started (a slow host starts Locust later), with most of
        # the load still to come.
        preempted = metrics.total(metrics.scrape(engine), metrics.PREEMPTIONS)
        deadline = time.monotonic() + LOAD_SECONDS
        while metrics.total(metrics.scrape(engine), metrics.PREEMPTIONS) == preempted:
            assert load.poll() is None, load_log.read_text()[-3000:]
            assert time.monotonic() < deadline, "six users on a 13-block pool never preempted"
            time.sleep(0.5)
        doctor = subprocess.run(
            cli("doctor", engine, "--window", str(DOCTOR_WINDOW_S)),
            capture_output=True, text=True, timeout=DOCTOR_WINDOW_S + 60, check=False,
        )  # fmt: skip
        (ARTIFACTS / "monitoring-doctor-pressured.log").write_text(doctor.stdout + doctor.stderr)
        assert load.wait(timeout=LOAD_SECONDS + 120) == 0, load_log.read_text()[-3000:]
    finally:
        stop_group(load, grace_s=5)
    loaded_at = time.time() - 5  # inside the load: every 1m window still covers it

    report = " ".join(doctor.stdout.split())
    assert doctor.returncode == 1, report
    assert "preemption" in report.lower(), report
    # The advice shows its arithmetic: the tokens the batch needs against what the pool holds.
    assert re.search(r"need [\d,]+ KV tokens; the pool holds 448", report), report
    # The block cap sizes this pool, not its 1 GiB budget: the advice names the cap.
    assert "raise num_gpu_blocks_override from 14 to at least" in report, report

    # Every dashboard target and alert expression parses and evaluates in the real Prometheus.
    for _dashboard, _panel, expr in dashboards.dashboard_targets():
        prometheus_query(prom, expr, at=loaded_at)
    for _alert, expr in alerts.alert_expressions():
        prometheus_query(prom, expr, at=loaded_at)
    # ... and the facts the issue names come back with plausible values.
    window = "1m"
    hit_rate = values(
        prometheus_query(prom, promql.prefix_cache_hit_rate(EVERYTHING, window, FLEET), loaded_at)
    )
    assert len(hit_rate) == 1 and 0.5 < hit_rate[0] <= 1.0, hit_rate
    preempting = values(prometheus_query(prom, promql.preemptions_per_s(EVERYTHING, window), loaded_at))
    assert preempting and max(preempting) > 0, preempting
    usage = values(prometheus_query(prom, f"max_over_time({metrics.KV_CACHE_USAGE}[2m])", loaded_at))
    assert usage and 0.95 < max(usage) <= 1.0, usage
    ttft = values(prometheus_query(
        prom, promql.latency_quantile(metrics.TTFT_SECONDS, 0.99, EVERYTHING, window), loaded_at
    ))  # fmt: skip
    assert ttft and all(0 < t < 600 for t in ttft), ttft
    # The residency histograms saw the pool turn over: sampled evictions, each after some idle time and
    # some lifetime; the prompt tokens split into computed and cached ones; no KV connector, no external
    # hit rate (no series rather than 0/0).
    evicted = values(prometheus_query(prom, promql.blocks_evicted_per_s(EVERYTHING, window), loaded_at))
    assert evicted and max(evicted) > 0, evicted
    for histogram in (metrics.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS, metrics.KV_BLOCK_LIFETIME_SECONDS):
        quantile = promql.block_residency_quantile(histogram, 0.5, EVERYTHING, window)
        seconds = values(prometheus_query(prom, quantile, loaded_at))
        assert seconds and all(0 < s < 600 for s in seconds), (histogram, seconds)
    sources = prometheus_query(prom, promql.prompt_tokens_by_source_per_s(EVERYTHING, window), loaded_at)
    by_source = {series["metric"]["source"]: float(series["value"][1]) for series in sources["result"]}
    assert by_source["local_compute"] > 0 and by_source["local_cache_hit"] > 0, by_source
    assert by_source["external_kv_transfer"] == 0, by_source
    external = prometheus_query(prom, promql.external_prefix_cache_hit_rate(EVERYTHING, window), loaded_at)
    assert external["result"] == [], external
    (ARTIFACTS / "monitoring-residency.txt").write_text(
        "\n".join(
            f"{expr}\n  {prometheus_query(prom, expr, loaded_at)['result']}"
            for _dashboard, panel, expr in dashboards.dashboard_targets()
            if "kv_block_" in expr
        )
    )

    # The KV-usage and preemption alerts went pending (or firing) during the load.
    seen = prometheus_query(
        prom, 'count by (alertname) (max_over_time(ALERTS{alertstate=~"pending|firing"}[10m]))'
    )
    raised = {series["metric"]["alertname"] for series in seen["result"]}
    assert {"KvtuneKvCacheNearlyFull", "KvtunePreemptions"} <= raised, raised

    # No dashboard or rule names a metric the live engine does not export, but the offload tier's (vLLM's
    # CPU build does not start with one: proven on synthetic series in tests/test_dashboards.py).
    exported = exported_names(engine)
    named = set().union(*(named_metrics(expr) for _d, _p, expr in dashboards.dashboard_targets()))
    named |= set().union(*(named_metrics(expr) for _a, expr in alerts.alert_expressions()))
    missing = sorted(name for name in named - set(metrics.KV_OFFLOAD) if name not in exported)
    assert not missing, f"not exported by vLLM: {missing}"

    # Reuse that the pool then loses: three distinct 7-block prompts asked for three times each in turn, on
    # 13 usable blocks. The 2nd and 3rd asks hit the 1st's blocks (one gap each), which the next prompt's
    # blocks evict: the reuse-gap queries read real gaps (the shared system prompt above is always in use,
    # so it is never evicted and shows none).
    with httpx.Client(base_url=engine, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        for turn in range(3 * 9):
            prompt = f"Topic {turn // 3 % 3}. {WARM_PROMPT}"
            client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4})
    time.sleep(3 * SCRAPE_INTERVAL_S)
    reused_at = time.time()
    gaps = values(prometheus_query(prom, promql.reuse_gaps_per_s(EVERYTHING, "2m"), reused_at))
    assert gaps and max(gaps) > 0, gaps
    for q in (0.5, 0.9):
        expr = promql.block_residency_quantile(metrics.KV_BLOCK_REUSE_GAP_SECONDS, q, EVERYTHING, "2m")
        gap_s = values(prometheus_query(prom, expr, reused_at))
        assert gap_s and all(0 < s < 600 for s in gap_s), (q, gap_s)
    residency_alert = alerts.residency_expr(EVERYTHING, "2m")
    (ARTIFACTS / "monitoring-residency.txt").open("a").write(
        f"\nafter the reuse burst: gaps/s {gaps}\n{residency_alert}\n  "
        f"{prometheus_query(prom, residency_alert, reused_at)['result']}\n"
    )

    # The same engine, warm and unpressured: one long prompt again and again, the doctor says healthy.
    # The TTFT target is set far above any host's speed: this asserts the KV diagnosis, not how fast a
    # busy machine prefills.
    # The prompt is cached once before the window opens: otherwise its first, missed, lookup weighs on the
    # window's hit rate as much as the host is slow (23 requests in 15 s on a busy host gave 89.1%).
    doctor_log = tmp_path / "doctor.out"
    with httpx.Client(base_url=engine, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        warm = {"model": model, "prompt": WARM_PROMPT, "max_tokens": 8}
        client.post("/v1/completions", json=warm).raise_for_status()
        with doctor_log.open("wb") as out:
            healthy = subprocess.Popen(
                cli("doctor", engine, "--window", "15", "--ttft-slo", "60"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            while healthy.poll() is None:
                client.post("/v1/completions", json=warm)
            healthy.wait(timeout=60)
    text = doctor_log.read_text()
    (ARTIFACTS / "monitoring-doctor-healthy.log").write_text(text)
    assert healthy.returncode == 0, text

    # Stopping `kvtune up` stops its Prometheus too.
    monitored.up.send_signal(signal.SIGTERM)
    assert monitored.up.wait(timeout=120) == 0, monitored.log.read_text()[-3000:]
    assert not group_members(monitored.up.pid)
    assert not port_in_use("127.0.0.1", int(prom.rsplit(":", 1)[1]))
