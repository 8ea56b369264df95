"""`kvtune doctor`: a window of an engine's own counters diagnosed, with the arithmetic behind the advice.

The engine is a local HTTP server whose /metrics is rendered by prometheus_client, as vLLM 0.32 renders
its own (the same metric names, label names and histogram buckets), and whose counters advance between
scrapes. Exit codes are checked through the real command line.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtune import cli, kv_math, metrics, metrics_window
from kvtune.commands import doctor as doctor_command
from kvtune.engine import free_port
from kvtune.observability import doctor
from kvtune.observability.prometheus_server import PrometheusServer, ScrapeTarget

MODEL = "m"
# vLLM 0.32.0's default buckets (vllm/v1/metrics/buckets.py): TTFT, the request phase timings, and the
# 1-2-5 token-count series up to max_model_len (8192 here).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
# vLLM 0.32.0's block residency buckets (`KV_CACHE_RESIDENCY_BUCKETS`), seconds.
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300,
                     600, 1200, 1800)  # fmt: skip
LABELS = ["model_name", "engine"]
# A SmolLM2-like geometry: 2 x 30 layers x 3 KV heads x 64 head dim x 2 bytes = 23,040 bytes/token, so
# 256 MiB of 16-bit KV is 728 blocks of 16 tokens.
CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
POOL_BYTES = 256 * 1024**2


def cache_config_labels(
    blocks: int = 728, block_size: int = 16, memory: int | None = POOL_BYTES, **others: str
) -> dict[str, str]:
    """Every label vLLM 0.32's `vllm:cache_config_info` carries (`CacheConfig.metrics_info()`)."""
    return {
        "block_size": str(block_size),
        "user_specified_block_size": "True",
        "kv_cache_layout": "None",
        "prefix_match_unit": "None",
        "gpu_memory_utilization": "0.92",
        "cache_dtype": "auto",
        "is_attention_free": "False",
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
        "enable_prefix_caching": "True",
        "prefix_caching_hash_algo": "sha256",
        "prefix_cache_retention_interval": "0",
        "kv_cache_dtype_skip_layers": "[]",
        "mamba_page_size_padded": "None",
        "skip_page_size_padded": "None",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_ssm_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "enable_mamba_shared_prefix_checkpoint": "False",
        "replayssm_buffer_len": "16",
        "use_replayssm": "False",
        "use_kda_recoverssm": "False",
        "num_gpu_blocks": str(blocks),
        "num_cpu_blocks": "None",
        "effective_attention_block_size": "None",
        "kv_cache_size_tokens": str(blocks * block_size),
        "kv_cache_max_concurrency": f"{blocks * block_size / 8192}",
        "hash_block_size": "None",
        "cache_hit_alignment_tokens": "None",
        "kv_sharing_fast_prefill": "False",
        "swa_bounded_replay": "True",
        "kv_cache_memory_bytes": str(memory),
        "kv_offloading_size": "None",
        "kv_offloading_backend": "native",
        "_block_size_resolved": "True",
        "engine": "0",
    } | others


class FakeVllm:
    """One engine's metrics, registered and rendered with prometheus_client the way vLLM's logger does;
    with `residency`, the block residency histograms of `--kv-cache-metrics` too."""

    def __init__(self, residency: bool = False, **cache: Any) -> None:
        self.registry = registry = CollectorRegistry()

        def counter(name: str) -> Any:
            return Counter(name, name, LABELS, registry=registry).labels(MODEL, "0")

        def histogram(name: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, name, LABELS, buckets=buckets, registry=registry).labels(MODEL, "0")

        def gauge(name: str) -> Any:
            return Gauge(name, name, LABELS, registry=registry).labels(MODEL, "0")

        self.queries = counter("vllm:prefix_cache_queries")
        self.hits = counter("vllm:prefix_cache_hits")
        self.preemptions = counter("vllm:num_preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens")
        self.generation_tokens = counter("vllm:generation_tokens")
        self.success = Counter(
            "vllm:request_success", "finished", [*LABELS, "finished_reason"], registry=registry
        ).labels(MODEL, "0", "stop")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc")
        self.running = gauge("vllm:num_requests_running")
        self.waiting = gauge("vllm:num_requests_waiting")
        by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason", "waiting", [*LABELS, "reason"], registry=registry
        )
        self.waiting_capacity = by_reason.labels(MODEL, "0", "capacity")
        self.waiting_deferred = by_reason.labels(MODEL, "0", "deferred")
        self.waiting_deferred.set(0)
        self.ttft = histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds", LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", LATENCY_BUCKETS)
        self.prompt_hist = histogram("vllm:request_prompt_tokens", TOKEN_BUCKETS)
        self.output_hist = histogram("vllm:request_generation_tokens", TOKEN_BUCKETS)
        labels = cache_config_labels(**cache)
        info = Gauge("vllm:cache_config_info", "CacheConfig", list(labels), registry=registry)
        info.labels(**labels).set(1)
        if residency:
            self.lifetime = histogram("vllm:kv_block_lifetime_seconds", RESIDENCY_BUCKETS)
            self.idle = histogram("vllm:kv_block_idle_before_evict_seconds", RESIDENCY_BUCKETS)
            self.reuse_gap = histogram("vllm:kv_block_reuse_gap_seconds", RESIDENCY_BUCKETS)

    def evict(self, blocks: int, idle_s: float, lifetime_s: float, gaps: tuple[float, ...] = ()) -> None:
        """BLOCKS sampled blocks evicted after IDLE_S idle, each with GAPS between its hits (as vLLM's
        logger observes an eviction event)."""
        for _ in range(blocks):
            self.lifetime.observe(lifetime_s)
            self.idle.observe(idle_s)
            for gap in gaps:
                self.reuse_gap.observe(gap)

    def serve(
        self,
        requests: int,
        prompt: int = 1000,
        output: int = 200,
        queue_s: float = 0.02,
        prefill_s: float = 0.08,
        hit_share: float = 0.0,
    ) -> None:
        """REQUESTS finished requests of PROMPT + OUTPUT tokens, HIT_SHARE of their prompt tokens cached."""
        for _ in range(requests):
            self.queries.inc(prompt)
            self.hits.inc(round(prompt * hit_share))
            self.prompt_tokens.inc(prompt)
            self.generation_tokens.inc(output)
            self.success.inc()
            self.queue.observe(queue_s)
            self.prefill.observe(prefill_s)
            self.ttft.observe(queue_s + prefill_s + 0.01)
            self.prompt_hist.observe(prompt)
            self.output_hist.observe(output)

    def gauges(self, kv: float, running: int, waiting: int = 0) -> None:
        self.kv_usage.set(kv)
        self.running.set(running)
        self.waiting.set(waiting)
        self.waiting_capacity.set(waiting)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def pressured(**cache: Any) -> list[str]:
    """Before, then after a window with 12 preemptions, 5 requests waiting for capacity and KV at 99%."""
    engine = FakeVllm(**cache)
    engine.serve(20, hit_share=0.5)
    before = engine.text()
    engine.serve(10, queue_s=1.5, prefill_s=0.3, hit_share=0.2)
    engine.preemptions.inc(12)
    engine.gauges(kv=0.99, running=8, waiting=5)
    return [before, engine.text()]


def warm() -> list[str]:
    engine = FakeVllm()
    engine.serve(50, hit_share=0.97)
    before = engine.text()
    engine.serve(20, hit_share=0.98)
    engine.gauges(kv=0.3, running=2)
    return [before, engine.text()]


def idle() -> list[str]:
    engine = FakeVllm()
    engine.serve(5, hit_share=0.9)
    return [engine.text()]


@dataclass
class Script:
    """What the fake engine answers: /metrics walks through `texts` (then repeats the last)."""

    texts: list[str]
    status: int = 200
    model_root: str = ""
    scrapes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    sampled: threading.Event = field(default_factory=threading.Event)  # set once a window is under way

    def next_text(self) -> str:
        with self.lock:
            text = self.texts[min(self.scrapes, len(self.texts) - 1)]
            self.scrapes += 1
            if self.scrapes >= 2:
                self.sampled.set()
            return text


@contextmanager
def fake_engine(script: Script) -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: str, content_type: str) -> None:
            data = body.encode()
            self.send_response(script.status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._send(script.next_text(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                entry = {"id": MODEL, "object": "model", "root": script.model_root or MODEL, "parent": None}
                self._send(json.dumps({"object": "list", "data": [entry]}), "application/json")
            else:
                self.send_error(404)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["doctor", *args])
    except SystemExit as exit_:  # argparse refused a flag's value, as it does for every subcommand
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, " ".join(err.split())


# ---- through the command line ---------------------------------------------------------------------------


def test_pressured_engine_is_unhealthy_with_the_arithmetic(
    capsys: pytest.CaptureFixture[str], model_dir: Path
) -> None:
    script = Script(pressured(), model_root=str(model_dir))
    with fake_engine(script) as url:
        code, out, _ = run(capsys, url, "--window", "1")
    assert code == 1, out
    assert "unhealthy" in out.splitlines()[0]
    assert re.search(r"WARN preemptions: 12 preemptions in 1 s \([0-9.]+/min\)", out), out
    assert re.search(r"12 / 1 s x 60 = [0-9.]+ per minute", out), out
    # 8 running + 5 waiting requests of 1,000 + 200 tokens: 75 blocks of 16 each, 975 blocks.
    assert (
        "8 running + 5 waiting requests of ~1,200 tokens need 15,600 KV tokens; the pool holds 11,648" in out
    )
    # 976 blocks (one is vLLM's null block) x 16 tokens x 23,040 bytes = 343.1 MiB.
    assert "raise kv_cache_memory_bytes from 256 MiB to at least 344 MiB" in out
    assert "the same 256 MiB holds 23,296 tokens (enough" in out
    assert "cap max_num_seqs at 9" in out
    assert "WARN kv_usage: peak KV usage 99%" in out
    assert "WARN waiting: up to 5 requests waited for capacity" in out
    assert "prefix-cache hit rate 20.0%: below the 90% alert" in out
    assert "mean TTFT 1.81 s = queue 1.50 s + prefill 0.30 s" in out
    assert "2 (K and V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes (auto) = 23,040 bytes/token" in out
    assert script.scrapes >= 2


def test_healthy_warm_engine_exits_0(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    with fake_engine(Script(warm(), model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1")
    assert code == 0, out
    assert out.startswith(f"kvtune doctor {url}: 1 s window: healthy")
    assert "WARN" not in out
    assert "prefix-cache hit rate 98.0%: healthy (at least 95%)" in out
    assert "19,600 hit / 20,000 queried prompt tokens = 98.0%" in out
    assert "ok   preemptions: no preemptions" in out
    assert "KV pool 11,648 tokens (728 blocks of 16), cache_dtype auto, prefix caching on" in out


def test_no_traffic_is_not_unhealthy(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_engine(Script(idle())) as url:
        code, out, _ = run(capsys, url, "--window", "1")
    assert code == 0, out
    assert doctor.NO_TRAFFIC in out
    assert "lifetime prefix-cache hit rate 90.0%" in out
    assert "preemptions" not in out and "TTFT" not in out
    # The served model is not a local directory: bytes per token come from the engine's own pool bytes.
    assert "KV pool 11,648 tokens" in out
    assert "not a directory with config.json on this machine" in out


def test_json_is_parseable_for_rollout_gates(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    with fake_engine(Script(pressured(), model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1", "--json")
    assert code == 1
    data = json.loads(out)
    assert data["healthy"] is False and data["url"] == url and data["source"] == "engine"
    levels = {finding["check"]: finding["level"] for finding in data["findings"]}
    assert levels["preemptions"] == "warn" and levels["kv_size"] == "warn" and levels["load"] == "ok"
    assert data["facts"]["preemptions"] == 12
    assert data["facts"]["peaks"]["waiting_by_reason"] == {"capacity": 5.0, "deferred": 0.0}
    assert data["kv_capacity"]["num_blocks"] == 728


def test_unreachable_url_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = run(capsys, url, "--window", "1")
    assert code == 2 and not out
    assert f"error: cannot reach {url}/metrics" in err
    assert "start the engine, or check the host and port" in err


def test_non_vllm_metrics_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    other = "# TYPE python_gc_objects_collected_total counter\npython_gc_objects_collected_total 12.0\n"
    with fake_engine(Script([other])) as url:
        code, _, err = run(capsys, url, "--window", "1")
    assert code == 2
    assert f"{url}/metrics has no vllm: metrics: {url} is not a vLLM engine" in err


def test_http_500_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_engine(Script(["oops"], status=500)) as url:
        code, _, err = run(capsys, url, "--window", "1")
    assert code == 2
    assert f"{url}/metrics answered HTTP 500" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["127.0.0.1:8000"], "URL '127.0.0.1:8000': expected a base URL such as http://127.0.0.1:8000"),
        (["u:secret@h:8000"], "URL 'u:***@h:8000': expected a base URL"),
        (["http://h:99999"], "URL 'http://h:99999': expected a base URL"),
        (["http://127.0.0.1:8000", "--window", "0"], "--window: 0 is not a usable number of seconds"),
        (
            ["http://127.0.0.1:8000", "--window", "inf"],
            "--window: inf is not a usable number of seconds; give one above 0 and at",
        ),
        (["http://127.0.0.1:8000", "--window", "nan"], "--window: nan is not a usable number"),
        (["http://127.0.0.1:8000", "--window", "1e9"], "at most 86,400 (a day)"),
        (["http://127.0.0.1:8000", "--ttft-slo", "nan"], "--ttft-slo: nan is not a usable number of seconds"),
        (
            ["http://127.0.0.1:8000", "--timeout", "0"],
            "--timeout: 0 is not a usable number of seconds; give one above 0 and at most 600",
        ),
        (["http://127.0.0.1:8000", "--timeout=-inf"], "--timeout: -inf is not a usable number of seconds"),
        (["http://127.0.0.1:8000", "--api-key-env", "KVTUNE_DOCTOR_UNSET"], "KVTUNE_DOCTOR_UNSET is unset"),
        (
            ["http://127.0.0.1:8000", "--api-key-env", "sk-live-123secret"],
            "--api-key-env takes the NAME of a variable holding the key, e.g. VLLM_API_KEY; the value given "
            "is not a variable name",
        ),
        (
            ["http://127.0.0.1:8000", "--api-key-env", "sk_live_123secret"],
            "the value given is not a variable name",
        ),
        (["http://127.0.0.1:8000", "--api-key-env", "abc123secret"], "the variable named is not set"),
        (
            ["http://127.0.0.1:8000", "--tensor-parallel-size", "0"],
            "argument --tensor-parallel-size: 0 is below 1; give 1 or more",
        ),
        (
            ["http://127.0.0.1:8000", "--tensor-parallel-size=-4"],
            "argument --tensor-parallel-size: -4 is below 1",
        ),
        (
            ["http://127.0.0.1:8000", "--pipeline-parallel-size", "0"],
            "argument --pipeline-parallel-size: 0 is below 1; give 1 or more",
        ),
        (
            ["http://127.0.0.1:8000", "--pipeline-parallel-size", "two"],
            "argument --pipeline-parallel-size: 'two' is not a whole number",
        ),
    ],
)
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    code, out, err = run(capsys, *args)
    assert code == 2 and not out
    assert message in err
    assert "secret" not in err  # a key given where its variable's name belongs is never shown


def test_ctrl_c_ends_a_real_window_early_and_diagnoses_it(model_dir: Path) -> None:
    script = Script(pressured(), model_root=str(model_dir))
    with fake_engine(script) as url:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtune.cli", "doctor", url, "--window", "120"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert script.sampled.wait(60), "the doctor never sampled the engine"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 1, out + err
    assert "Traceback" not in err
    assert re.match(rf"kvtune doctor {url}: [0-9]+ s window \(ended early\): unhealthy", out), out
    assert "12 preemptions in" in out


# ---- the window, with an injected client and clock --------------------------------------------------------


class FakeClock:
    def __init__(self, interrupt_at: int | None = None) -> None:
        self.now = 0.0
        self.sleeps = 0
        self.interrupt_at = interrupt_at

    def __call__(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        """Returns True (asked to stop) at the `interrupt_at`-th wait, as Ctrl-C would."""
        self.sleeps += 1
        if self.sleeps == self.interrupt_at:
            return True
        self.now += seconds
        return False


def mock_client(texts: list[str]) -> tuple[httpx.Client, list[str]]:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL, "root": MODEL}]})
        return httpx.Response(200, text=texts[min(seen.count("/metrics") - 1, len(texts) - 1)])

    return httpx.Client(transport=httpx.MockTransport(handler)), seen


def test_gauges_are_sampled_every_second_and_peaks_kept() -> None:
    engine = FakeVllm()
    before = engine.text()
    engine.gauges(kv=0.97, running=6, waiting=3)  # only the middle samples see the burst
    burst = engine.text()
    engine.gauges(kv=0.2, running=1)
    after = engine.text()
    client, seen = mock_client([before, burst, burst, after])
    clock = FakeClock()
    observation = doctor_command.watch_engine(
        doctor_command.Reader(client), "http://e", 3.0, clock=clock, wait=clock.wait
    )
    assert seen.count("/metrics") == 4  # start, two samples, end
    assert observation.facts.seconds == 3.0 and not observation.ended_early
    assert observation.facts.peaks.kv_usage == 0.97
    assert observation.facts.peaks.waiting_by_reason["capacity"] == 3
    assert observation.facts.running == 1  # the end of the window
    assert observation.model == MODEL


def test_ctrl_c_ends_the_window_and_diagnoses_what_was_seen() -> None:
    engine = FakeVllm()
    before = engine.text()
    engine.preemptions.inc(4)
    client, seen = mock_client([before, engine.text()])
    clock = FakeClock(interrupt_at=3)
    observation = doctor_command.watch_engine(
        doctor_command.Reader(client), "http://e", 30.0, clock=clock, wait=clock.wait
    )
    assert observation.ended_early
    assert observation.facts.seconds == 2.0
    assert observation.facts.preemptions == 4
    assert seen.count("/metrics") == 4  # start, two samples, and one more when Ctrl-C came


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ([{"id": "m"}], "answered a list, not an object with a 'data' list"),
        ({"data": "m"}, "answered an object, not an object with a 'data' list"),
        ({"data": [{"id": 7, "root": ["a"]}]}, "lists a model whose root and id are not a usable name"),
        (
            {"data": [{"id": "m", "root": "x" * 5000}]},
            "lists a model whose root and id are not a usable name",
        ),
        ({"data": [{"id": "m", "root": "a\0b"}]}, "lists a model whose root and id are not a usable name"),
        ({"data": []}, "lists no model"),
    ],
)
def test_a_model_list_of_the_wrong_shape_is_said_not_raised(answer: Any, why: str) -> None:
    client = httpx.Client(transport=httpx.MockTransport(lambda _request: httpx.Response(200, json=answer)))
    model, reason = doctor_command.served_model(doctor_command.Reader(client), "http://e")
    assert model is None
    assert reason == f"http://e/v1/models {why}; pass --model DIR"


def test_a_model_list_with_nan_is_not_json() -> None:
    body = b'{"data": [{"id": "m", "root": NaN}]}'
    client = httpx.Client(transport=httpx.MockTransport(lambda _request: httpx.Response(200, content=body)))
    _, reason = doctor_command.served_model(doctor_command.Reader(client), "http://e")
    assert reason == "http://e/v1/models did not answer JSON (NaN is not a JSON number); pass --model DIR"


# ---- the diagnosis, pure ----------------------------------------------------------------------------------


def samples(text: str) -> list[metrics.Sample]:
    return metrics.parse(text)


def test_waiting_with_kv_room_points_at_the_batch_limit() -> None:
    engine = FakeVllm()
    before = engine.text()
    engine.serve(10)
    engine.gauges(kv=0.4, running=8, waiting=5)
    after = samples(engine.text())
    peaks = metrics_window.Peaks()
    peaks.update(after)
    findings = doctor.diagnose_snapshots(
        samples(before), after, peaks, 30.0, kv_math.KvBytes(None, "unknown")
    )
    by_check = {finding.check: finding for finding in findings}
    assert by_check["waiting"].level == "warn"
    assert "the batch limits held them, not the KV pool" in by_check["waiting"].text
    assert "raise max_num_seqs above 8" in by_check["waiting"].text
    assert "room for 9 requests of ~1,200 tokens (727 usable blocks / 75 blocks of 16 each)" in (
        by_check["waiting"].arithmetic
    )
    assert "kv_size" not in by_check  # the pool is not the limit
    assert not doctor.healthy(findings)


def test_without_bytes_per_token_the_advice_is_in_tokens_and_says_why() -> None:
    engine = FakeVllm(memory=None)
    before = engine.text()
    engine.serve(10)
    engine.preemptions.inc(3)
    engine.gauges(kv=0.99, running=8, waiting=5)
    after = samples(engine.text())
    peaks = metrics_window.Peaks()
    peaks.update(after)
    kv = kv_math.resolve_kv_bytes(metrics.cache_config(after), None, "no config.json here")
    assert kv.per_token is None
    findings = doctor.diagnose_snapshots(samples(before), after, peaks, 60.0, kv)
    sizing = next(finding for finding in findings if finding.check == "kv_size")
    assert "grow the KV pool to at least 15,616 tokens (976 blocks)" in sizing.text
    assert "use kv_cache_dtype fp8 (1 byte per element: at least twice the tokens)" in sizing.text
    assert "its size in bytes needs the model's KV bytes per token, unknown here: no config.json here" in (
        sizing.arithmetic
    )
    preempt = next(finding for finding in findings if finding.check == "preemptions")
    assert preempt.arithmetic == "3 / 60 s x 60 = 3.0 per minute"


def test_bytes_per_token_follow_the_pool_the_engine_allocated() -> None:
    geometry = kv_math.geometry_from_config(CONFIG)
    assert geometry is not None
    # kvtune's CPU profile: float32 weights, auto KV, 1 GiB, blocks of 128: 4-byte elements, 182 blocks.
    fp32 = cache_config_labels(blocks=182, block_size=128, memory=1024**3)
    kv = kv_math.resolve_kv_bytes(fp32, geometry, "")
    assert kv.per_token == 46_080 and kv.fp8_per_token == 11_520
    assert "32-bit model dtype: it turns kv_cache_memory_bytes 1,073,741,824 into the 182 blocks" in kv.how
    sixteen = kv_math.resolve_kv_bytes(cache_config_labels(), geometry, "")
    assert sixteen.per_token == 23_040 and "16-bit model dtype" in sixteen.how
    # No geometry: the engine's own bytes over its tokens.
    ratio = kv_math.resolve_kv_bytes(cache_config_labels(), None, "no config")
    assert ratio.per_token == 23_045 and "(no config)" in ratio.how  # 256 MiB / 11,648, floored


def test_bucket_quantile_matches_prometheus() -> None:
    # 100 observations: 90 at or under 0.1 s, 9 in (0.1, 0.25], 1 in (0.25, 0.5].
    buckets = {0.1: 90.0, 0.25: 99.0, 0.5: 100.0, float("inf"): 100.0}
    assert metrics_window.bucket_quantile(0.99, buckets) == pytest.approx(0.25)
    assert metrics_window.bucket_quantile(0.5, buckets) == pytest.approx(0.1 * 50 / 90)
    assert metrics_window.bucket_quantile(0.995, buckets) == pytest.approx(0.375)
    assert metrics_window.bucket_quantile(0.99, {float("inf"): 0.0}) is None


def test_a_restart_in_the_window_gives_no_rate_and_says_so() -> None:
    # Before: 100 of 1,000 prompt tokens hit. After a restart: 90 of 1,010. Taken naively the window
    # would have 90 hits for 10 queries, a 900% hit rate.
    engine = FakeVllm()
    engine.serve(1, prompt=1000, hit_share=0.1)
    engine.preemptions.inc(50)
    before = samples(engine.text())
    fresh = FakeVllm()
    fresh.serve(1, prompt=1010, hit_share=90 / 1010)
    after = samples(fresh.text())
    facts = metrics_window.from_snapshots(before, after, metrics_window.Peaks(), 10.0).known()
    assert facts.counters_reset
    assert facts.reset_detail == "vllm:prefix_cache_hits_total went down from 100 to 90"
    assert facts.hits == facts.queries == facts.preemptions == 0.0 and facts.mean_ttft_s is None
    assert facts.unknown["hits"] == facts.unknown["mean_ttft_s"] == metrics_window.RESTARTED
    findings = doctor.diagnose(facts, doctor.capacity_of(after), metrics.cache_config(after), NO_BYTES)
    by_check = {finding.check: finding for finding in findings}
    assert by_check["restart"].level == "warn"
    assert by_check["restart"].text.startswith(
        "the engine restarted in the window (vllm:prefix_cache_hits_total went down from 100 to 90): its "
        "counters started again from zero"
    )
    assert {"hit_rate", "preemptions", "ttft", "traffic", "unreadable"}.isdisjoint(by_check)
    assert not doctor.healthy(findings)
    data = doctor.report("engine", facts, None, findings)
    assert data["facts"]["hits"] is None and data["facts"]["p99_ttft_s"] is None
    assert data["facts"]["unknown"]["hits"] == metrics_window.RESTARTED
    json.loads(json.dumps(data, allow_nan=False))


NO_BYTES = kv_math.KvBytes(None, "unknown")


def test_skipped_samples_leave_their_checks_without_a_verdict() -> None:
    engine = FakeVllm()
    before = samples(engine.text())
    engine.serve(10, hit_share=0.97)
    text = engine.text().replace(
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 9700.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} +Inf',
    )
    assert "+Inf\n" in text
    exposition = metrics.read_exposition(text)
    assert exposition.skipped == {metrics.PREFIX_CACHE_HITS: "is +Inf"}
    assert exposition.skipped_text() == "1 sample skipped: vllm:prefix_cache_hits_total is +Inf"
    facts = metrics_window.from_snapshots(
        before, exposition.samples, metrics_window.Peaks(), 10.0, exposition.skipped
    )
    assert facts.unknown == {
        "hits": "vllm:prefix_cache_hits_total is +Inf",
        "lifetime_hits": "vllm:prefix_cache_hits_total is +Inf",
    }
    after = exposition.samples
    findings = doctor.diagnose(facts, doctor.capacity_of(after), metrics.cache_config(after), NO_BYTES)
    by_check = {finding.check: finding for finding in findings}
    assert "hit_rate" not in by_check
    assert by_check["unreadable"].level == "warn"
    assert by_check["unreadable"].text == (
        "no verdict on hit_rate: samples they need were skipped (vllm:prefix_cache_hits_total is +Inf)"
    )
    assert by_check["preemptions"].level == "ok"  # what could be read is still judged


def test_a_pool_label_that_is_no_number_is_named() -> None:
    engine = FakeVllm(blocks=728)
    text = engine.text().replace('num_gpu_blocks="728"', 'num_gpu_blocks="inf"')
    after = samples(text)
    capacity, cache, problems = doctor.pool_of(after)
    assert capacity is None and "num_gpu_blocks" not in cache
    assert problems == ["vllm:cache_config_info's num_gpu_blocks is 'inf', not a whole number"]
    kv = kv_math.resolve_kv_bytes(cache, None, "no config")
    facts = metrics_window.from_snapshots(after, after, metrics_window.Peaks(), 1.0)
    findings = doctor.diagnose(facts, capacity, cache, kv, pool_problems=problems)
    pool = next(finding for finding in findings if finding.check == "kv_pool")
    assert pool.level == "warn"
    assert pool.text == (
        "the KV pool is unknown: vllm:cache_config_info's num_gpu_blocks is 'inf', not a whole number"
    )


def test_the_json_report_has_no_nan_or_infinity() -> None:
    facts = metrics_window.WindowFacts(
        seconds=10.0, mean_ttft_s=math.inf, peaks=metrics_window.Peaks(kv_usage=math.nan)
    )
    data = doctor.report("engine", facts, None, [])
    assert data["facts"]["mean_ttft_s"] is None and data["facts"]["peaks"]["kv_usage"] is None
    assert data["facts"]["unknown"]["mean_ttft_s"] == "inf is not a finite number"
    assert data["facts"]["unknown"]["peaks.kv_usage"] == "nan is not a finite number"
    json.loads(json.dumps(data, allow_nan=False))


# ---- through a real Prometheus ----------------------------------------------------------------------------


def wait_for_scrapes(prometheus: str, engines: int, count: int, timeout_s: float = 30.0) -> None:
    """Until Prometheus holds COUNT scrapes of each of ENGINES engines (no event says so: polled)."""
    expr = "count_over_time(vllm:num_preemptions_total[1m])"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5.0)
        result = response.json()["data"]["result"]
        if len(result) == engines and all(float(r["value"][1]) >= count for r in result):
            return
        time.sleep(0.25)
    raise AssertionError(f"Prometheus at {prometheus} did not scrape {engines} engines {count} times")


def test_prometheus_mode_reads_the_same_facts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path
) -> None:
    with fake_engine(Script(pressured())) as hot, fake_engine(Script(warm())) as calm:
        targets = [
            ScrapeTarget(name, "127.0.0.1", int(url.rsplit(":", 1)[1]))
            for name, url in (("hot", hot), ("calm", calm))
        ]
        server = PrometheusServer(
            targets, "groups: []\n", tmp_path / "prom", port=free_port(), interval_s=1.0
        )
        with server:
            wait_for_scrapes(server.url, engines=2, count=3)
            args = ["--prometheus", "--window", "60", "--model", str(model_dir)]
            code, out, _ = run(capsys, server.url, *args, "--selector", 'kvtune_engine="hot"')
            healthy, calm_out, _ = run(capsys, server.url, *args, "--selector", '{kvtune_engine="calm"}')
            both, _, both_err = run(capsys, server.url, *args)
            missing, _, missing_err = run(capsys, server.url, "--prometheus", "--selector", 'job="nope"')
    assert code == 1, out
    # Prometheus' increase() extrapolates to the window's edges, so counts and means are near, not exact.
    assert re.search(r"WARN preemptions: 1[0-9] preemptions in 60 s", out), out
    sizing = (
        r"8 running \+ 5 waiting requests of ~1,[12][0-9]{2} tokens need 1[56],[0-9]{3} KV tokens; "
        r"the pool holds 11,648"
    )
    assert re.search(sizing, out), out
    assert "peak KV usage 99%" in out
    assert healthy == 0, calm_out
    assert re.search(r"prefix-cache hit rate 9[5-9]\.[0-9]%: healthy", calm_out), calm_out
    assert both == 2
    assert "2 engines match (no --selector)" in both_err and "narrow --selector" in both_err
    assert missing == 2
    assert f'{server.url} has no vllm:cache_config_info series (--selector job="nope")' in missing_err


def test_a_pool_sized_by_memory_share_is_told_to_set_kv_cache_memory_bytes() -> None:
    engine = FakeVllm(memory=None)
    before = engine.text()
    engine.serve(10)
    engine.gauges(kv=0.99, running=8, waiting=5)
    after = samples(engine.text())
    peaks = metrics_window.Peaks()
    peaks.update(after)
    kv = kv_math.resolve_kv_bytes(metrics.cache_config(after), kv_math.geometry_from_config(CONFIG), "")
    assert kv.per_token == 23_040 and "16-bit model dtype assumed (vLLM's auto)" in kv.how
    findings = doctor.diagnose_snapshots(samples(before), after, peaks, 30.0, kv)
    sizing = next(finding for finding in findings if finding.check == "kv_size")
    assert (
        "set kv_cache_memory_bytes to at least 344 MiB (gpu_memory_utilization 0.92 sizes the pool now)"
        in sizing.text
    )
    assert "the same 256 MiB holds 23,296 tokens (enough" in sizing.arithmetic


def test_a_pool_capped_by_a_block_override_is_told_to_raise_the_cap() -> None:
    # The byte budget would hold far more: the override is what limits the pool (as in a test engine).
    engine = FakeVllm(blocks=14, block_size=32, memory=1024**3, num_gpu_blocks_override="14")
    before = engine.text()
    engine.serve(10)
    engine.preemptions.inc(4)
    engine.gauges(kv=1.0, running=2, waiting=5)
    after = samples(engine.text())
    peaks = metrics_window.Peaks()
    peaks.update(after)
    kv = kv_math.resolve_kv_bytes(metrics.cache_config(after), kv_math.geometry_from_config(CONFIG), "")
    findings = doctor.diagnose_snapshots(samples(before), after, peaks, 30.0, kv)
    sizing = next(finding for finding in findings if finding.check == "kv_size")
    assert "the pool holds 448: raise num_gpu_blocks_override from 14 to at least" in sizing.text
    assert "kv_cache_memory_bytes" not in sizing.text


# ---- a tensor- or pipeline-parallel engine: KV bytes per GPU --------------------------------------------

# A Llama-3.1-70B-shaped config.json: 80 layers, 64 query heads, 8 KV heads, hidden 8192 (head dim 128).
LLAMA_70B = {
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "hidden_size": 8192,
}
# By hand: 2 (K and V) x layers x KV heads x 128 head dim x 1 byte (fp8), on the GPU holding the most.
FP8_ONE_GPU = 2 * 80 * 8 * 128 * 1  # 163,840 bytes/token
FP8_TP4 = 2 * 80 * (8 // 4) * 128 * 1  # each of 4 GPUs holds 2 of the 8 KV heads: 40,960
FP8_TP2_PP2 = 2 * (80 // 2) * (8 // 2) * 128 * 1  # 40 layers x 4 KV heads on each of 4 GPUs: 40,960


@pytest.fixture
def llama_70b_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    return tmp_path


@pytest.mark.parametrize(
    ("flags", "per_token", "explained", "on"),
    [
        (
            ["--tensor-parallel-size", "4"],
            FP8_TP4,
            "2 (K and V) x 80 layers x 2 KV heads (8 / TP 4) x 128 head dim x 1 byte (fp8) = 40,960 "
            "bytes/token per GPU",
            " per GPU (TP 4)",
        ),
        (
            ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"],
            FP8_TP2_PP2,
            "2 (K and V) x 40 layers (80 / PP 2) x 4 KV heads (8 / TP 2) x 128 head dim x 1 byte (fp8) = "
            "40,960 bytes/token per GPU",
            " per GPU (TP 2 x PP 2)",
        ),
        (
            [],
            FP8_ONE_GPU,
            "2 (K and V) x 80 layers x 8 KV heads x 128 head dim x 1 byte (fp8) = 163,840 bytes/token",
            "",
        ),
    ],
)
def test_a_parallel_engine_is_sized_per_gpu(
    capsys: pytest.CaptureFixture[str],
    llama_70b_dir: Path,
    flags: list[str],
    per_token: int,
    explained: str,
    on: str,
) -> None:
    # vLLM's num_gpu_blocks is one GPU's: every rank holds these 728 blocks of its own layers and heads.
    # gpu_memory_utilization sized the pool (no kv_cache_memory_bytes), so its bytes come from the model.
    script = Script(pressured(cache_dtype="fp8", memory=None), model_root=str(llama_70b_dir))
    with fake_engine(script) as url:
        code, out, err = run(capsys, url, "--window", "1", *flags)
    assert code == 1, out + err
    assert explained in out
    # 728 blocks x 16 = 11,648 tokens; x 40,960 bytes = 477,102,080 bytes = 455 MiB on each GPU (TP 4).
    pool_tokens = 728 * 16
    pool = kv_math.format_bytes(pool_tokens * per_token)
    assert f"KV pool {pool_tokens:,} tokens (728 blocks of 16), cache_dtype fp8, prefix caching on" in out
    assert (f"prefix caching on;{on}: {per_token:,} bytes/token, {pool}" in out) == bool(on)
    # 8 running + 5 waiting requests of 75 blocks need 975 blocks, + vLLM's null block = 976 blocks.
    target = 976 * 16 * per_token
    target_mib = f"{-(-target // 1024**2):,} MiB"
    assert f"set kv_cache_memory_bytes to at least {target_mib}{on} (gpu_memory_utilization 0.92" in out
    assert f"976 blocks x 16 tokens x {per_token:,} bytes/token{on} = {target:,} bytes = {target_mib}" in out
    if on:
        assert per_token == 40_960 and target_mib == "610 MiB" and pool == "455.00 MiB"
    else:
        assert per_token == 163_840 and target_mib == "2,440 MiB" and "per GPU" not in out
    assert "check --tensor-parallel-size" not in err  # no explicit budget: nothing to set the sizes against


def test_a_parallel_engines_json_names_its_sizes(
    capsys: pytest.CaptureFixture[str], llama_70b_dir: Path
) -> None:
    script = Script(pressured(cache_dtype="fp8", memory=None), model_root=str(llama_70b_dir))
    with fake_engine(script) as url:
        code, out, _ = run(capsys, url, "--window", "1", "--json", "--tensor-parallel-size", "4")
    assert code == 1
    data = json.loads(out)
    assert data["parallel"] == {"tensor_parallel_size": 4, "pipeline_parallel_size": 1}
    pool = next(finding for finding in data["findings"] if finding["check"] == "kv_pool")
    assert "per GPU (TP 4): 40,960 bytes/token" in pool["text"]


# A TP 4 engine whose 16-bit pool has an explicit budget of 1 GiB per GPU: at 2 x 80 x 2 x 128 x 2 =
# 81,920 bytes/token per GPU, 1 GiB is 819 whole blocks of 16 (819.2).
BF16_TP4 = 2 * 80 * (8 // 4) * 128 * 2
TP4_BUDGET = 1024**3
TP4_BLOCKS = TP4_BUDGET // (BF16_TP4 * 16)


def test_a_budgeted_parallel_pool_is_sized_per_gpu_and_its_sizes_checked(
    capsys: pytest.CaptureFixture[str], llama_70b_dir: Path
) -> None:
    assert TP4_BLOCKS == 819
    script = Script(pressured(blocks=TP4_BLOCKS, memory=TP4_BUDGET), model_root=str(llama_70b_dir))
    with fake_engine(script) as url:
        code, out, err = run(capsys, url, "--window", "1", "--tensor-parallel-size", "4")
        code_1, out_1, err_1 = run(capsys, url, "--window", "1")
    assert code == 1 and code_1 == 1, out + err
    # At TP 4 the engine's 1 GiB and its 819 blocks agree with 16-bit elements on each GPU.
    assert f"16-bit model dtype: it turns kv_cache_memory_bytes {TP4_BUDGET:,} into the 819 blocks" in out
    assert "prefix caching on; per GPU (TP 4): 81,920 bytes/token, 1.00 GiB" in out
    # 976 blocks x 16 x 81,920 = 1,279,262,720 bytes = 1,220 MiB, a budget each GPU gets.
    assert "raise kv_cache_memory_bytes from 1,024 MiB to at least 1,220 MiB per GPU (TP 4)" in out
    # fp8 on each GPU: 40,960 bytes/token; 1 GiB / (40,960 x 16) = 1,638 whole blocks = 26,208 tokens.
    assert "fp8: 40,960 bytes/token per GPU (TP 4), the same 1,024 MiB holds 26,208 tokens (enough" in out
    assert "check --tensor-parallel-size" not in err
    # Without the flag the model's whole 327,680 bytes/token disagree with the pool's own ~81,940
    # (1 GiB / 13,104 tokens): the doctor says the sizes look wrong, since vLLM's metrics do not give them.
    own = TP4_BUDGET // (TP4_BLOCKS * 16)
    assert own == 81_940
    assert (
        f"the engine's pool holds ~{own:,} bytes/token per GPU (kv_cache_memory_bytes {TP4_BUDGET:,} / "
        f"13,104 tokens) but the model on one GPU needs {4 * BF16_TP4:,} (~4.0x)" in err_1
    )
    assert "check --tensor-parallel-size and --pipeline-parallel-size" in err_1
    assert "16-bit model dtype assumed (vLLM's auto)" in out_1


def test_parallel_sizes_the_model_cannot_take_exit_2(
    capsys: pytest.CaptureFixture[str], llama_70b_dir: Path
) -> None:
    script = Script(pressured(cache_dtype="fp8", memory=None), model_root=str(llama_70b_dir))
    with fake_engine(script) as url:
        code, out, err = run(capsys, url, "--window", "1", "--tensor-parallel-size", "3")
        code_pp, out_pp, err_pp = run(capsys, url, "--window", "1", "--pipeline-parallel-size", "81")
    assert code == 2 and not out
    assert (
        "error: --tensor-parallel-size 3 --pipeline-parallel-size 1 cannot be the engine's: "
        "tensor_parallel_size 3 does not divide the model's 64 attention heads" in err
    )
    assert code_pp == 2 and not out_pp
    assert "pipeline_parallel_size 81 exceeds the model's 80 layers" in err_pp


def test_per_gpu_arithmetic_is_kv_maths() -> None:
    geometry = kv_math.geometry_from_config(LLAMA_70B)
    assert geometry is not None
    cache = cache_config_labels(blocks=TP4_BLOCKS, memory=TP4_BUDGET)
    kv = kv_math.resolve_kv_bytes(cache, geometry, "", tp=4)
    assert (kv.per_token, kv.fp8_per_token) == (BF16_TP4, FP8_TP4)
    assert doctor_command.sizes_doubt(cache, kv, 4, 1) is None
    whole = kv_math.resolve_kv_bytes(cache, geometry, "")
    assert (whole.per_token, whole.fp8_per_token) == (4 * BF16_TP4, FP8_ONE_GPU)
    assert doctor_command.sizes_doubt(cache, whole, 1, 1) is not None
    assert doctor.per_gpu_basis() == "" and doctor.per_gpu_basis(1, 4) == "per GPU (PP 4)"


# ---- block residency ------------------------------------------------------------------------------------


def residency_window(
    idle_s: float = 3.0,
    gaps: tuple[float, ...] = (1.5, 8.0),
    evicted: int = 40,
    hit_share: float = 0.5,
    **cache: Any,
) -> tuple[list[metrics.Sample], list[metrics.Sample]]:
    """Before and after a window of 10 requests (HIT_SHARE of their prompt tokens cached) in which EVICTED
    sampled blocks are evicted after IDLE_S idle (4 s after allocation), each with GAPS between its hits."""
    engine = FakeVllm(residency=True, **cache)
    engine.serve(20, hit_share=hit_share)
    before = samples(engine.text())
    engine.serve(10, hit_share=hit_share)
    engine.evict(evicted, idle_s, 4.0, gaps)
    return before, samples(engine.text())


def residency_finding(
    before: list[metrics.Sample], after: list[metrics.Sample], kv: kv_math.KvBytes | None = None
) -> doctor.Finding:
    kv = kv or kv_math.resolve_kv_bytes(metrics.cache_config(after), kv_math.geometry_from_config(CONFIG), "")
    findings = doctor.diagnose_snapshots(before, after, metrics_window.Peaks(), 30.0, kv)
    (finding,) = [finding for finding in findings if finding.check == "residency"]
    return finding


def test_reuse_reaching_the_eviction_horizon_is_evictions_before_reuse_with_the_pool_to_set() -> None:
    finding = residency_finding(*residency_window())
    assert finding.level == "warn"
    # 40 evictions, all idle in (2, 5]: median 2 + 3 x 20 / 40 = 3.5 s. 40 x 2 gaps: 40 in (1, 2], 40 in
    # (5, 10]: p90 at rank 72, 5 + 5 x (72 - 40) / 40 = 9 s; median at rank 40, the (1, 2] bucket's top.
    assert finding.text == (
        "evictions before reuse: blocks are evicted after a median 3.50 s idle while reuses wait up to "
        "9.00 s (p90 of 80 gaps) and 50.0% of prompt tokens hit: prefixes asked for again later than "
        "~3.50 s are prefilled again; raise kv_cache_memory_bytes from 256 MiB to at least 1,317 MiB"
    )
    *lines, bytes_line = finding.arithmetic.splitlines()
    assert lines == [
        "blocks are evicted after a median 3.50 s idle (40 sampled evictions, lifetime median 3.50 s)",
        "reuse gap: median 2.00 s, p90 9.00 s over 80 gaps; hit rate 50.0% (vLLM records a gap only for a "
        "block that survived it, so the gaps stop near the eviction horizon)",
        "under LRU at a fixed arrival of new blocks a block's idle time before eviction grows in proportion "
        "to the pool: to keep blocks 18.0 s idle (2 x the p90 gap), 2 x 9.00 s / 3.50 s = 5.14x the pool",
        # 728 x 36 / 7 = 3,744 blocks; x 16 tokens x 23,040 bytes = 1,380,188,160 bytes = 1,316.25 MiB.
        "728 blocks x 5.14 = 3,744 blocks of 16 = 59,904 tokens",
    ]
    assert bytes_line.startswith(
        "3,744 blocks x 16 tokens x 23,040 bytes/token = 1,380,188,160 bytes = 1,317 MiB "
        "(2 (K and V) x 30 layers x 3 KV heads x 64 head dim x 2 bytes (auto) = 23,040 bytes/token"
    )


def test_a_pool_capped_by_blocks_is_told_the_cap_and_one_sized_by_share_the_bytes() -> None:
    capped = residency_finding(*residency_window(blocks=36, block_size=32, num_gpu_blocks_override="36"))
    # 36 x 36 / 7 = 185.14: 186 blocks.
    assert capped.text.endswith("raise num_gpu_blocks_override from 36 to at least 186")
    assert "36 blocks x 5.14 = 186 blocks of 32 = 5,952 tokens" in capped.arithmetic
    shared = residency_finding(*residency_window(memory=None))
    assert shared.text.endswith(
        "set kv_cache_memory_bytes to at least 1,317 MiB (gpu_memory_utilization 0.92 sizes the pool now)"
    )


@pytest.mark.parametrize(
    ("window", "text"),
    [
        (  # every reuse well inside the time a block lasts idle
            {"idle_s": 8.0, "gaps": (0.3, 0.8)},
            # gaps 40 in (0.2, 0.5], 40 in (0.5, 1]: p90 0.5 + 0.5 x 32 / 40; idle (5, 10]: 5 + 5 x 20 / 40
            "reuse comes within residency: p90 reuse gap 0.90 s < p50 idle before eviction 7.50 s",
        ),
        (  # reaching the horizon, but almost every prompt token hits: nothing worth a larger pool
            {"hit_share": 0.97},
            "reuse reaches the eviction horizon (p90 reuse gap 9.00 s >= p50 idle before eviction 3.50 s), "
            "but 97.0% of prompt tokens hit: little is lost",
        ),
        (  # a handful of evictions is noise
            {"evicted": 5},
            "5 sampled KV blocks evicted in the window: too few (under 20) to judge how long blocks stay "
            "cached",
        ),
        (  # evictions but hardly a reuse: the horizon is the fact
            {"gaps": ()},
            "blocks are evicted after a median 3.50 s idle (40 sampled evictions, lifetime median 3.50 s); 0 "
            "reuse gaps, too few (under 20) to compare with it: vLLM counts a block's gaps when it is "
            "evicted, so reused blocks that stay cached show none",
        ),
    ],
    ids=["within", "hitting", "few-evictions", "few-reuses"],
)
def test_residency_that_loses_nothing_worth_a_pool_is_ok(window: dict[str, Any], text: str) -> None:
    finding = residency_finding(*residency_window(**window))
    assert (finding.level, finding.text) == ("ok", text)


def test_without_residency_histograms_the_doctor_says_how_to_turn_them_on(
    capsys: pytest.CaptureFixture[str], model_dir: Path
) -> None:
    with fake_engine(Script(warm(), model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1")
    assert code == 0, out
    assert "ok   residency: vLLM exports no KV block residency histograms: set kv_cache_metrics: true" in out


def test_evictions_before_reuse_through_the_command_line(
    capsys: pytest.CaptureFixture[str], model_dir: Path
) -> None:
    before, after = residency_window()
    texts = [metrics_text(before), metrics_text(after)]
    with fake_engine(Script(texts, model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1", "--json")
    assert code == 1, out
    data = json.loads(out)
    (finding,) = [f for f in data["findings"] if f["check"] == "residency"]
    assert finding["level"] == "warn" and finding["text"].startswith("evictions before reuse")
    facts = data["facts"]
    assert (facts["evicted_blocks"], facts["reuse_gaps"], facts["residency_exported"]) == (40, 80, True)
    assert facts["idle_before_evict_s"] == pytest.approx(3.5) and facts["reuse_gap_s"] == pytest.approx(9.0)


def metrics_text(scraped: list[metrics.Sample]) -> str:
    """Samples back as an exposition, untyped (as a scrape that lost its TYPE lines reads)."""
    lines = []
    for sample in scraped:
        labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
        lines.append(f"{sample.name}{{{labels}}} {sample.value!r}")
    return "\n".join(lines) + "\n"


HOSTILE_BUCKETS = [
    (  # cumulative counts that go down with le: no engine's
        'vllm:kv_block_idle_before_evict_seconds_bucket{engine="0",le="10.0",model_name="m"} 40.0',
        'vllm:kv_block_idle_before_evict_seconds_bucket{engine="0",le="10.0",model_name="m"} 7.0',
        'vllm:kv_block_idle_before_evict_seconds_bucket{engine="0",model_name="m"} has 7 observations up to '
        "le=10 but 40 up to le=5: buckets count every observation below their bound, so they never go down; "
        "these numbers cannot come from one vLLM engine",
    ),
    (  # a count below zero: no engine's
        'vllm:kv_block_reuse_gap_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0',
        'vllm:kv_block_reuse_gap_seconds_bucket{engine="0",le="0.001",model_name="m"} -3.0',
        'vllm:kv_block_reuse_gap_seconds_bucket{engine="0",le="0.001",model_name="m"} = -3: it counts, so it '
        "is never negative; these numbers cannot come from one vLLM engine",
    ),
]


def residency_text() -> tuple[str, str]:
    """An engine's /metrics before and after a window with residency histograms."""
    engine = FakeVllm(residency=True)
    engine.serve(20, hit_share=0.5)
    before = engine.text()
    engine.serve(10, hit_share=0.5)
    engine.evict(40, 3.0, 4.0, (1.5, 8.0))
    return before, engine.text()


@pytest.mark.parametrize(("line", "hostile", "why"), HOSTILE_BUCKETS, ids=["decreasing", "negative"])
def test_residency_buckets_no_histogram_has_are_refused_where_they_are_read(
    line: str, hostile: str, why: str
) -> None:
    _, text = residency_text()
    assert line in text
    with pytest.raises(metrics.ImpossibleMetrics) as refused:
        metrics.read_exposition(text.replace(line, hostile))
    assert str(refused.value) == why


def test_residency_buckets_that_are_no_number_give_no_verdict() -> None:
    before, text = residency_text()
    line = 'vllm:kv_block_reuse_gap_seconds_bucket{engine="0",le="2.0",model_name="m"} 40.0'
    assert line in text
    exposition = metrics.read_exposition(text.replace(line, line.replace("40.0", "NaN")))
    facts = metrics_window.from_snapshots(
        samples(before), exposition.samples, metrics_window.Peaks(), 30.0, exposition.skipped
    )
    cache = metrics.cache_config(exposition.samples)
    findings = doctor.diagnose(facts, doctor.capacity_of(exposition.samples), cache, NO_BYTES)
    by_check = {finding.check: finding for finding in findings}
    assert "residency" not in by_check
    why = "vllm:kv_block_reuse_gap_seconds_bucket is NaN"
    assert by_check["unreadable"].text == f"no verdict on residency: samples they need were skipped ({why})"
    data = doctor.report("engine", facts, None, findings)
    json.loads(json.dumps(data, allow_nan=False))
    assert data["facts"]["reuse_gap_s"] is None


def test_prometheus_mode_judges_residency_from_the_same_buckets(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, model_dir: Path
) -> None:
    before, after = residency_window()
    with fake_engine(Script([metrics_text(before), metrics_text(after)])) as starved:
        target = ScrapeTarget("starved", "127.0.0.1", int(starved.rsplit(":", 1)[1]))
        server = PrometheusServer(
            [target], "groups: []\n", tmp_path / "prom", port=free_port(), interval_s=1.0
        )
        with server:
            wait_for_scrapes(server.url, engines=1, count=3)
            code, out, _ = run(
                capsys, server.url, "--prometheus", "--window", "60", "--model", str(model_dir)
            )
    assert code == 1, out
    # increase() extrapolates every bucket by the same factor: the quantiles, not the counts, are exact.
    warning = "WARN residency: evictions before reuse: blocks are evicted after a median 3.50 s idle while "
    assert f"{warning}reuses wait up to 9.00 s" in " ".join(out.split()), out


# ---- the pool judged by a trace of the traffic -----------------------------------------------------------


def chat_trace_file(folder: Path, conversations: int) -> Path:
    from kvtune.traces.format import write_trace
    from kvtune.traces.synthetic import ChatTraceShape, chat_trace

    path = folder / f"chat-{conversations}.jsonl"
    shape = ChatTraceShape(conversations=conversations, block_size=16, system_tokens=64, user_tokens=48)
    with path.open("w") as file:
        write_trace(file, chat_trace(shape), 16)
    return path


def test_a_trace_sizes_the_pool_by_its_curve(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    from kvtune.traces.analysis import trace_curve
    from kvtune.traces.format import read_trace
    from kvtune.traces.tokens import BlockMapping

    trace = chat_trace_file(model_dir, 600)
    curve = trace_curve(read_trace(trace), BlockMapping(16, 16, 16)).curve
    target = curve.smallest_pool_reaching(0.95)
    assert target > 727  # more than the fake engine's 728 blocks (one is vLLM's) keep
    with fake_engine(Script(warm(), model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1", "--trace", str(trace))
    assert code == 1, out
    assert (
        f"WARN trace_curve: the pool keeps {curve.hit_rate(727):.1%} of {trace.name}'s prompt tokens" in out
    )
    # The target pool plus vLLM's null block, in blocks of 16 tokens at 23,040 bytes a token.
    needed = math.ceil((target + 1) * 16 * 23_040 / 2**20)
    assert f"raise kv_cache_memory_bytes from 256 MiB to at least {needed:,} MiB" in out
    assert f"95% of the ideal ({0.95 * curve.ideal_hit_rate:.1%}) from {target:,} usable blocks" in out
    assert "the window's own hit rate 98.0%" in out


def test_a_trace_the_pool_holds_is_healthy(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    trace = chat_trace_file(model_dir, 20)
    with fake_engine(Script(warm(), model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1", "--trace", str(trace))
    assert code == 0, out
    assert f"ok   trace_curve: the pool holds what {trace.name} reuses: predicted" in out


def test_a_bad_trace_exits_2_before_the_window(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": "x"}\n')
    script = Script(warm())
    with fake_engine(script) as url:
        code, _, err = run(capsys, url, "--window", "30", "--trace", str(bad))
    assert code == 2 and f"{bad}:1: hash_ids is a string" in err
    assert script.scrapes == 0  # refused before the engine was read, not 30 s later


def test_with_a_trace_the_residency_check_leaves_the_pool_s_size_to_its_curve(
    capsys: pytest.CaptureFixture[str], model_dir: Path
) -> None:
    before, after = residency_window()
    texts = [metrics_text(before), metrics_text(after)]
    trace = chat_trace_file(model_dir, 20)
    with fake_engine(Script(texts, model_root=str(model_dir))) as url:
        code, out, _ = run(capsys, url, "--window", "1", "--json", "--trace", str(trace))
    findings = {f["check"]: f for f in json.loads(out)["findings"]}
    residency = findings["residency"]
    assert residency["level"] == "warn" and residency["text"].startswith("evictions before reuse")
    assert residency["text"].endswith("; the trace's curve sizes the pool (trace_curve)")
    assert "x the pool" not in residency["arithmetic"]  # no size of its own
    assert "trace_curve" in findings and code == 1
