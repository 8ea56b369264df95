"""vllm-router (the vLLM project's Rust router, `pip install vllm-router`) in front of the benchmark's
engines: the rows a user would get by picking it instead of kvtune's router.

Read from vllm-router 0.1.17 (its --help, and run in front of stand-in engines, tests/test_peer_router.py):
- Started as `vllm-router --host 127.0.0.1 --port P --worker-urls URL... --policy POLICY
  --prometheus-port M --log-level info --worker-startup-timeout-secs T --worker-startup-check-interval 1`.
  It listens once one worker's GET /health has answered (it waits up to the startup timeout, 600 s by
  default, then exits 1), and counts the others healthy until its health checks (every 60 s, 3 failures)
  say otherwise: its GET /readiness ({"status": "ready", "healthy_workers": N, ...}) cannot tell a dead
  engine, so `vllm_router` asks every engine's /health itself before starting it.
- Flags set here, and why: the Prometheus exporter is always on from the CLI (127.0.0.1:29000 unless told;
  the help's "disabled if not specified" is wrong) and a taken port makes the router panic, so it gets a
  free port; the startup timeout is a little under our own readiness deadline, so a router waiting on a
  dead engine exits with its reason before we give up on it; the startup check interval (30 s by default)
  only paces that wait. Every routing knob keeps its default.
- round_robin: the workers in turn. cache_aware (defaults: cache_threshold 0.3, balance_abs_threshold 64,
  balance_rel_threshold 1.5, eviction_interval_secs 120, max_tree_size 2**25): per model, a radix tree of
  the token ids of the prompts it has routed, each branch tagged with the workers it went to. A match over
  cache_threshold of the prompt goes to the worker with the longest match, a lower one to the worker with
  the fewest requests in flight; when the loads part (max - min > 64 and max > 1.5 x min) the least loaded
  worker takes it whatever it matched.
- cache_aware gets those token ids from the engines: for each chat request it asks every worker to render
  it (POST /v1/chat/completions/render; on a 404 it tries POST /tokenize). vLLM answers render with 403
  unless started with `--enable-scale-out` (ENGINE_ARGS), and on a 403 vllm-router neither tries /tokenize
  nor matches text: it routes by load alone and counts vllm_router_prefix_routing_decisions_total
  {outcome="missing_tokens"}. So `vllm_router` refuses to start cache_aware in front of an engine whose
  render endpoint is off (`require_render=False` measures that degraded setup on purpose).
- It re-serialises each request with SGLang-style fields (ignore_eos, skip_special_tokens,
  separate_reasoning, ...); vLLM ignores the ones it does not know, with a warning.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from kvtune import metrics
from kvtune.engine import free_port
from kvtune.processes import stop_group

PIN = "vllm-router==0.1.17"
PEER_POLICIES = ("cache_aware", "round_robin")
# The engine flag cache_aware needs: vLLM serves /v1/chat/completions/render only with it.
ENGINE_ARGS = ("--enable-scale-out",)
HOST = "127.0.0.1"
POLL_S = 0.2
# The router gives up on its workers this much before our own deadline, so its exit and reason reach us.
STARTUP_MARGIN_S = 5.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # its log is coloured even into a file
# cache_aware's decisions by outcome: prefix_hit, prefix_miss, missing_tokens (no token ids from the engines).
PREFIX_DECISIONS = "vllm_router_prefix_routing_decisions_total"


def vllm_router_binary(bin_dir: Path | None = None) -> Path:
    """The `vllm-router` script of this interpreter's environment (the venv's bin), or a RuntimeError."""
    folder = bin_dir if bin_dir is not None else Path(sys.executable).parent
    path = folder / "vllm-router"
    if not path.is_file():
        raise RuntimeError(
            f"vllm-router is not installed: no {path}; install the pin with `{folder / 'pip'} install "
            f"'{PIN}'` (it is in pyproject's dev extra, which `make setup` installs)"
        )
    return path


def vllm_router_version() -> str:
    """The installed vllm-router's version, for the results table."""
    try:
        return importlib.metadata.version("vllm-router")
    except importlib.metadata.PackageNotFoundError as err:
        raise RuntimeError(f"vllm-router is not installed; install the pin `{PIN}`") from err


def router_argv(
    binary: Path, policy: str, engine_urls: list[str], port: int, metrics_port: int, startup_timeout_s: float
) -> list[str]:
    if policy not in PEER_POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(PEER_POLICIES)}")
    return [
        str(binary), "--host", HOST, "--port", str(port), "--worker-urls", *engine_urls,
        "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--log-level", "info", "--worker-startup-timeout-secs", str(max(1, math.ceil(startup_timeout_s))),
        "--worker-startup-check-interval", "1",
    ]  # fmt: skip


def check_render(engine_url: str, model: str) -> None:
    """Refuse an engine that cannot give cache_aware its token ids (see the module docstring)."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}]}
    try:
        render = httpx.post(f"{engine_url}/v1/chat/completions/render", json=body, timeout=30)
        if render.status_code == 200 and render.json().get("token_ids"):
            return
        if render.status_code == 404:  # vllm-router falls back to /tokenize on a 404 only
            tokenize = httpx.post(f"{engine_url}/tokenize", json=body, timeout=30)
            if tokenize.status_code == 200 and tokenize.json().get("tokens"):
                return
    except (httpx.HTTPError, ValueError) as err:
        raise RuntimeError(f"{engine_url}: cannot check its render endpoint: {err}") from err
    raise RuntimeError(
        f"{engine_url}: POST /v1/chat/completions/render answered {render.status_code}: vllm-router's "
        f"cache_aware gets no token ids from it and routes by load alone; start the engine with "
        f"{' '.join(ENGINE_ARGS)}"
    )


def check_health(engine_url: str) -> None:
    """Refuse an engine that is not serving (vllm-router would start in front of it all the same)."""
    try:
        httpx.get(f"{engine_url}/health", timeout=10).raise_for_status()
    except httpx.HTTPError as err:
        raise RuntimeError(
            f"{engine_url}: GET /health failed ({err}); vllm-router starts in front of any engine once "
            f"one answers, and sends this one its share of the requests"
        ) from err


def prefix_outcomes(metrics_port: int) -> dict[str, float]:
    """cache_aware's decisions so far by outcome, from the router's exporter on `metrics_port`."""
    outcomes: dict[str, float] = {}
    for sample in metrics.scrape(f"http://{HOST}:{metrics_port}"):
        if sample.name == PREFIX_DECISIONS:
            outcome = sample.labels.get("outcome", "")
            outcomes[outcome] = outcomes.get(outcome, 0.0) + sample.value
    return outcomes


def _log_tail(log_path: Path, chars: int = 3000) -> str:
    try:
        return _ANSI.sub("", log_path.read_text(errors="replace"))[-chars:]
    except OSError as err:
        return f"(no log: {err})"


def _not_ready(base: str, engines: int, model: str) -> str | None:
    """Why the router is not ready yet, None once it is: every engine healthy in its view, and a request
    forwarded (/v1/models through it lists `model`)."""
    try:
        readiness = httpx.get(f"{base}/readiness", timeout=2)
        if readiness.status_code != 200 or readiness.json().get("healthy_workers") != engines:
            return f"GET /readiness answered {readiness.status_code}: {readiness.text[:200]}"
        models = httpx.get(f"{base}/v1/models", timeout=5)
        served = [m.get("id") for m in models.json().get("data", [])] if models.status_code == 200 else []
        if model not in served:
            return f"GET /v1/models through it answered {models.status_code}, serving {served}, not {model!r}"
    except (httpx.HTTPError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return None


@contextlib.contextmanager
def vllm_router(
    policy: str,
    engine_urls: list[str],
    port: int,
    log_path: Path,
    model: str,
    *,
    ready_timeout_s: float = 120.0,
    metrics_port: int | None = None,
    require_render: bool = True,
    bin_dir: Path | None = None,
) -> Iterator[str]:
    """vllm-router with `policy` on 127.0.0.1:`port` in front of `engine_urls` (already serving `model`),
    its output in `log_path`; yields its base URL, stops its process group on the way out.

    `metrics_port`: its Prometheus exporter (a free port when None); `bin_dir`: where to find it (the
    running interpreter's bin when None).
    """
    argv = router_argv(
        vllm_router_binary(bin_dir), policy, engine_urls, port, metrics_port or free_port(),
        startup_timeout_s=ready_timeout_s - STARTUP_MARGIN_S,
    )  # fmt: skip
    for url in engine_urls:
        check_health(url)
        if policy == "cache_aware" and require_render:
            check_render(url, model)
    base = f"http://{HOST}:{port}"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while reason := _not_ready(base, len(engine_urls), model):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"vllm-router ({policy}) exited with code {proc.returncode} before it was ready; "
                    f"{log_path}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vllm-router ({policy}) not ready after {ready_timeout_s:.0f} s ({reason}); "
                    f"{log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(POLL_S)
        yield base
    finally:
        stop_group(proc, grace_s=5)
