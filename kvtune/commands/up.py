"""`kvtune up PROFILE...`: launch, warm and supervise one vLLM engine per profile until Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import sys
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import zmq
from rich.console import Console

from kvtune.commands.common import (
    ExitCode,
    add_cache_dir_flag,
    add_log_dir_flag,
    add_ttft_slo_flag,
    count,
    load_profiles,
    number_between,
    port_number,
    seconds,
    whole_number_between,
)
from kvtune.config_errors import ConfigError
from kvtune.control_api import ControlServer, check_exposure
from kvtune.engine import Engine, EngineError, check_port_free, free_port, log_file
from kvtune.files import ensure_writable_folder
from kvtune.model_store import ModelPrepareError, resolve_model
from kvtune.observability import alerts
from kvtune.observability.prometheus_server import (
    DEFAULT_PORT,
    INSTALL_HINT,
    PrometheusError,
    PrometheusServer,
    ScrapeTarget,
)
from kvtune.port_plan import PortUse, bound, check_plan, draw_ports, engine_ports
from kvtune.profile import EngineProfile
from kvtune.router.capture import CapturePlan, CaptureSettings
from kvtune.router.capture_files import FILE_GLOB
from kvtune.router.fleet import check_fleet, expand_replicas
from kvtune.router.policies import ROUTER_POLICIES
from kvtune.router.request_limits import LARGEST_MAX_BODY_MIB, SMALLEST_MAX_BODY_MIB
from kvtune.router.server import RouterOptions, RouterServer, fleet_router, fleet_targets, router_options_for
from kvtune.router.workers import MAX_WORKERS, RouterWorkers
from kvtune.slo import DEFAULT_TTFT_P99_SLO_S
from kvtune.supervisor import RestartPolicy, State, Supervisor

log = logging.getLogger(__name__)
console = Console(stderr=True)
# A capture's bound by default: 16 files of 64 MiB per router process, ~2.6 million requests of ~400 bytes.
DEFAULT_CAPTURE_MIB = 64.0
DEFAULT_CAPTURE_KEEP = 16
# A capture file from ~10 KiB (a few dozen requests) to 16 GiB, and up to 10,000 of them per router process:
# past these a number is a typo (or `inf`), and below the least it would be rounded into a silent limit.
CAPTURE_MIB_RANGE = (0.01, 16384.0)
MOST_CAPTURE_FILES = 10_000
# Above 1 the prefix policies balance at all; at 100 times the mean load they have long stopped balancing.
MOST_LOAD_FACTOR = 100.0
# Where the local Prometheus listens (the plan probes the port there before anything starts).
PROMETHEUS_HOST = "127.0.0.1"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profiles", nargs="+", type=Path, metavar="PROFILE", help="engine profile YAML files")
    parser.add_argument(
        "--control-host", default="127.0.0.1", help="control API address (default %(default)s)"
    )
    parser.add_argument(
        "--control-port", type=port_number, default=8099, help="control API port (default %(default)s)"
    )
    add_log_dir_flag(parser)
    parser.add_argument(
        "--ready-timeout",
        type=seconds,
        default=None,
        help="seconds an engine may take to serve (default: each profile's ready_timeout_s)",
    )
    parser.add_argument(
        "--max-restarts",
        type=count,
        default=5,
        help="restarts of a crashing engine before giving up (default %(default)s)",
    )
    parser.add_argument(
        "--stop-grace",
        type=seconds,
        default=None,
        help="seconds engines get to stop before SIGKILL (default: the profile's shutdown_timeout + 10)",
    )
    add_cache_dir_flag(parser)
    routing = parser.add_argument_group("router (in front of several engines)")
    routing.add_argument(
        "--router",
        choices=("auto", "none", *ROUTER_POLICIES),
        default="auto",
        help="routing policy; auto (default): a router starts with two engines or more, kv_events when "
        "every engine publishes KV events (kv_events_port), else prefix; none: no router",
    )
    routing.add_argument(
        "--router-port",
        type=port_number,
        default=8080,
        help="the router's port on 127.0.0.1 (default %(default)s)",
    )
    routing.add_argument(
        "--router-workers",
        type=whole_number_between(1, MAX_WORKERS),
        default=1,
        metavar="N",
        help=f"router processes sharing --router-port, 1 to {MAX_WORKERS} (the kernel spreads connections "
        "over them; more than the host's cores add memory, not throughput); each hears every engine's KV "
        "events, listens on a port of its own for its metrics, and is started again if it dies (default "
        "%(default)s: the router runs inside kvtune)",
    )
    routing.add_argument(
        "--router-load-factor",
        type=number_between(1, MOST_LOAD_FACTOR, above=True),
        default=1.5,
        help="prefix policies: an engine above this many times the mean load (plus one) takes no request "
        f"by prefix; above 1 and at most {MOST_LOAD_FACTOR:g} (default %(default)s)",
    )
    routing.add_argument(
        "--router-max-body-mib",
        type=number_between(SMALLEST_MAX_BODY_MIB, LARGEST_MAX_BODY_MIB, "MiB"),
        default=None,
        help=f"largest request body the router takes, {SMALLEST_MAX_BODY_MIB:g} to {LARGEST_MAX_BODY_MIB:g} "
        "MiB (default: sized from max_model_len and the tokenizer's longest token; larger bodies get 413 "
        "without reaching an engine)",
    )
    routing.add_argument(
        "--router-kv-events-off-loopback",
        action="store_true",
        help="receive KV events on an engine's non-loopback address; the socket takes no key, so anyone "
        "who reaches it can steer routing (default: loopback only, refused otherwise)",
    )
    capture = parser.add_argument_group("traffic capture (by the router)")
    capture.add_argument(
        "--capture-trace",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the traffic the router serves into DIR as a trace without its text (arrival times, "
        "token counts, keyed prefix-block ids); DIR must hold no earlier capture",
    )
    capture.add_argument(
        "--capture-max-mib",
        type=number_between(*CAPTURE_MIB_RANGE, "MiB"),
        default=None,
        help=f"size of each capture file before the next is started, {CAPTURE_MIB_RANGE[0]:g} to "
        f"{CAPTURE_MIB_RANGE[1]:g} MiB (default {DEFAULT_CAPTURE_MIB:g})",
    )
    capture.add_argument(
        "--capture-keep",
        type=whole_number_between(1, MOST_CAPTURE_FILES),
        default=None,
        help=f"capture files each router process keeps, the oldest deleted, 1 to {MOST_CAPTURE_FILES:,} "
        f"(default {DEFAULT_CAPTURE_KEEP})",
    )
    monitoring = parser.add_argument_group("monitoring")
    monitoring.add_argument(
        "--prometheus",
        action="store_true",
        help="also start a local Prometheus scraping the engines and evaluating kvtune's alert rules",
    )
    monitoring.add_argument(
        "--prometheus-port",
        type=port_number,
        default=DEFAULT_PORT,
        help="its port on 127.0.0.1 (default %(default)s)",
    )
    monitoring.add_argument(
        "--scrape-interval",
        type=seconds,
        default=5.0,
        help="seconds between scrapes and rule evaluations (default %(default)s)",
    )
    add_ttft_slo_flag(
        monitoring,
        default=DEFAULT_TTFT_P99_SLO_S,
        help_text="P99 time to first token, seconds, above which the TTFT alert fires (default %(default)s)",
    )


def _prometheus(
    args: argparse.Namespace, profiles: list[EngineProfile], router: RouterOptions | None
) -> PrometheusServer | None:
    """The local Prometheus `--prometheus` asks for, checked (binary, port, SLO) before anything starts."""
    if not args.prometheus:
        return None
    server = PrometheusServer(
        [ScrapeTarget(p.name, p.host, p.port) for p in profiles] + router_scrape_targets(router),
        alerts.render_rules(ttft_p99_slo_seconds=args.ttft_slo),
        args.log_dir / "prometheus",
        host=PROMETHEUS_HOST,
        port=args.prometheus_port,
        interval_s=args.scrape_interval,
    )
    if shutil.which(server.binary) is None:
        raise ConfigError(f"--prometheus: `{server.binary}` is not on PATH; {INSTALL_HINT}")
    return server


def _check_distinct_names(profiles: list[EngineProfile]) -> str | None:
    dupes = [name for name, count in Counter(p.name for p in profiles).items() if count > 1]
    if dupes:
        return f"two profiles share name {dupes[0]}; give each engine its own name"
    return None


# An engine as `kvtune up` plans it: the profile it runs, the file its numbers come from, which replica.
Planned = tuple[EngineProfile, str, int]


def plan_ports(
    args: argparse.Namespace, engines: Sequence[Planned], router: RouterOptions | None
) -> tuple[list[PortUse], RouterOptions | None]:
    """Every port this run uses, checked together before anything starts (ConfigError naming both users of
    a port, or one out of range), and ROUTER with its workers' ports drawn from the ones left."""
    uses = [
        use
        for profile, origin, replica in engines
        for use in engine_ports(profile, origin, replica, events_bound=router is not None)
    ]
    if router is not None:
        uses.append(PortUse(router.port, "the router", "--router-port", router.host))
    uses.append(PortUse(args.control_port, "the control API", "--control-port", args.control_host))
    if args.prometheus:
        uses.append(PortUse(args.prometheus_port, "Prometheus", "--prometheus-port", PROMETHEUS_HOST))
    check_plan(uses)
    if router is not None and router.workers > 1:
        workers = [f"router worker {index}" for index in range(router.workers)]
        drawn = draw_ports(uses, workers, router.host, free_port)
        uses += drawn
        router = dataclasses.replace(router, worker_ports=tuple(use.port for use in drawn))
    return uses, router


def _load(paths: list[Path]) -> list[tuple[EngineProfile, str | None, Planned]]:
    """Each engine the profiles at PATHS stand for (replicas expanded), with its host note and its plan."""
    return [
        (replica, note, (replica, str(path), index))
        for path, (profile, note) in zip(paths, load_profiles(paths), strict=True)
        for index, replica in enumerate(expand_replicas(profile))
    ]


def main(args: argparse.Namespace) -> int:
    try:
        engines = _load(args.profiles)
        loaded = [(profile, note) for profile, note, _plan in engines]
        profiles = [profile for profile, _note in loaded]
        for profile, note in loaded:
            if note:
                console.print(f"note: engine {profile.name}: {note}")
        clash = _check_distinct_names(profiles)
        if clash:
            console.print(f"[red]error:[/red] {clash}")
            return ExitCode.CONFIG
        body_mib = args.router_max_body_mib
        router_options = router_options_for(
            args.router,
            profiles,
            args.router_port,
            args.router_load_factor,
            kv_events_off_loopback=args.router_kv_events_off_loopback,
            max_body_bytes=None if body_mib is None else round(body_mib * 2**20),
            workers=args.router_workers,
        )
        if router_options is not None:
            check_fleet(profiles)
        ports, router_options = plan_ports(args, [plan for _p, _n, plan in engines], router_options)
        for host, use in bound(ports):  # each probed where it will be bound, before anything binds it
            check_port_free(host, use.port, str(use))
        for profile in profiles:
            profile.check_credentials()
        check_exposure(args.control_host, _api_keys(profiles))
        capture = _capture_plan(args, router_options)
        ensure_writable_folder(args.log_dir, "--log-dir")
        prometheus = _prometheus(args, profiles, router_options)
        model_paths = [resolve_model(p.model, args.cache_dir) for p in profiles]
    except EngineError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return ExitCode.CONFIG
    except ModelPrepareError as exc:
        console.print(f"[red]error:[/red] {exc}")
        return ExitCode.FAILED
    stop = threading.Event()
    received: list[int] = []
    # Everything that starts registers its stop here as soon as it runs, so a start that fails (and the
    # normal end) stops what had started, newest first: router, engines, control API, Prometheus.
    with contextlib.ExitStack() as started:
        try:
            supervisor, control_url, router = _start(
                started, args, loaded, model_paths, router_options, prometheus, (stop, received), capture
            )
        except _StartFailed as exc:
            console.print(f"[red]error:[/red] {exc}")
            return ExitCode.FAILED
        failed = _serve(supervisor, control_url, router, stop)
        console.print("Stopping engines...")
    if failed:
        for status in supervisor.statuses():
            if status.state == State.FAILED:
                console.print(f"[red]engine {status.name} failed for good:[/red] {status.last_failure}")
        return ExitCode.FAILED
    console.print(f"All engines stopped ({signal.Signals(received[0]).name if received else 'done'}).")
    return ExitCode.OK


Router = RouterServer | RouterWorkers


def router_scrape_targets(router: RouterOptions | None) -> list[ScrapeTarget]:
    """The router's /metrics for Prometheus: its port, or each worker's own (labelled by worker)."""
    if router is None:
        return []
    if not router.worker_ports:
        return [ScrapeTarget("router", router.host, router.port)]
    return [
        ScrapeTarget("router", router.host, port, worker=str(index))
        for index, port in enumerate(router.worker_ports)
    ]


class _StartFailed(Exception):
    """A start that failed; str() is the user-facing message."""


def _stop_on_signals(stack: contextlib.ExitStack, stop: threading.Event, received: list[int]) -> None:
    """SIGTERM and SIGINT set STOP (and are recorded) until STACK closes, which puts the old handlers back."""

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        stack.callback(signal.signal, sig, signal.signal(sig, on_signal))


def _start(
    stack: contextlib.ExitStack,
    args: argparse.Namespace,
    loaded: list[tuple[EngineProfile, str | None]],
    model_paths: list[str],
    router_options: RouterOptions | None,
    prometheus: PrometheusServer | None,
    signals: tuple[threading.Event, list[int]],
    capture: CapturePlan | None = None,
) -> tuple[Supervisor, str, Router | None]:
    """Start Prometheus, the control API, the engines and the router, in that order, each one's stop put on
    STACK once it runs; _StartFailed when one cannot start (STACK then stops the ones before it). SIGNALS
    (an event and the signals received) catch SIGTERM and SIGINT once the engines are about to start."""
    if prometheus is not None:
        stack.callback(prometheus.stop)  # a no-op unless its process started
        try:
            prometheus.start()
        except PrometheusError as exc:
            raise _StartFailed(f"--prometheus: {exc}") from exc
        console.print(
            f"Prometheus: {prometheus.url} (alerts at {prometheus.url}/alerts; point Grafana's "
            f"Prometheus data source there); config and log in {prometheus.folder}/"
        )
    # From here a signal stops the engines through the normal path (before, Ctrl-C simply interrupts).
    _stop_on_signals(stack, *signals)
    profiles = [profile for profile, _note in loaded]
    engines = [
        Engine(
            p,
            log_file(args.log_dir, p),
            model_path=path,
            ready_timeout=args.ready_timeout,
            stop_grace=args.stop_grace,
        )
        for p, path in zip(profiles, model_paths, strict=True)
    ]
    notes = {profile.name: note for profile, note in loaded if note}
    supervisor = Supervisor(engines, RestartPolicy(max_restarts=args.max_restarts), notes)
    control = ControlServer(supervisor, args.control_host, args.control_port, _api_keys(profiles))
    control.start()
    stack.callback(control.stop)
    supervisor.start()
    stack.callback(supervisor.stop)
    console.print(
        f"Starting {len(engines)} engine(s); logs in {args.log_dir}/, status at {control.url}/engines"
    )
    if router_options is None:
        return supervisor, control.url, None
    router = _start_router(
        router_options, profiles, model_paths[0], args.log_dir, capture.start() if capture else None
    )
    stack.callback(router.stop)
    if isinstance(router, RouterWorkers):
        control.show_router_workers(router.statuses)
    return supervisor, control.url, router


def _start_router(
    options: RouterOptions,
    profiles: list[EngineProfile],
    model_path: str,
    log_dir: Path,
    capture: CaptureSettings | None = None,
) -> Router:
    """The router in this process, or its workers; _StartFailed (nothing left running) if it cannot."""
    router: Router
    try:
        if options.workers == 1:
            router = fleet_router(options, profiles, model_path, capture)
        else:
            settings, targets = fleet_targets(options, profiles, model_path)
            router = RouterWorkers(options, targets, settings, model_path, log_dir, capture=capture)
    except (OSError, RuntimeError, ValueError) as exc:  # a tokenizer that cannot load
        raise _StartFailed(f"the router could not start: {exc}; stopping the engines") from exc
    try:
        router.start()
    except (OSError, RuntimeError, ValueError, zmq.ZMQError) as exc:  # a port taken since the check
        with contextlib.suppress(RuntimeError):  # its thread may never have started: nothing to join
            router.stop()
        raise _StartFailed(f"the router could not start: {exc}; stopping the engines") from exc
    if isinstance(router, RouterWorkers):
        ports = ", ".join(str(slot.port) for slot in router.slots)
        console.print(
            f"Router ({options.policy}, {options.workers} workers): {router.url}/v1; each worker's metrics "
            f"on its own port ({ports}), logs in {log_dir}/router-worker-*.log"
        )
    else:
        console.print(f"Router ({options.policy}): {router.url}/v1, metrics at {router.url}/metrics")
    if capture is not None:
        console.print(
            f"Capturing the traffic served as a trace (no text) in {capture.folder}/{FILE_GLOB}; "
            f"`kvtune trace merge {capture.folder} -o trace.jsonl` makes one trace of it"
        )
    return router


def _capture_plan(args: argparse.Namespace, router: RouterOptions | None) -> CapturePlan | None:
    """What `--capture-trace` asks for, its folder checked; ConfigError for a capture that cannot run."""
    if args.capture_trace is None:
        flags = {"--capture-max-mib": args.capture_max_mib, "--capture-keep": args.capture_keep}
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise ConfigError(f"{given[0]} sets up a capture: add --capture-trace DIR, or drop {given[0]}")
        return None
    if router is None:
        raise ConfigError(
            f"--capture-trace {args.capture_trace}: the router captures the traffic, and no router runs "
            "here; pass --router round_robin (or another policy) to put it in front of one engine"
        )
    mib = args.capture_max_mib if args.capture_max_mib is not None else DEFAULT_CAPTURE_MIB
    keep = args.capture_keep if args.capture_keep is not None else DEFAULT_CAPTURE_KEEP
    plan = CapturePlan(args.capture_trace, round(mib * 2**20), keep)
    plan.check()
    return plan


def _serve(supervisor: Supervisor, control_url: str, router: Router | None, stop: threading.Event) -> bool:
    """Supervise the engines until a signal (False) or an engine failing for good (True)."""
    supervisor.wait_all_settled(stop)
    if router is not None:  # "ready" below means ready through the router too
        ready = [status.name for status in supervisor.statuses() if status.state == State.READY]
        for name in router.wait_seen_ready(ready):
            console.print(f"[yellow]warning:[/yellow] the router does not see engine {name} ready yet")
    _print_engines(supervisor, control_url)
    while not stop.wait(1.0):
        if any(status.state == State.FAILED for status in supervisor.statuses()):
            return True
    return False


def _api_keys(profiles: list[EngineProfile]) -> list[str]:
    """The engines' API keys: the control API asks for one of them when there are any."""
    return [key for profile in profiles if (key := profile.api_key())]


def _print_engines(supervisor: Supervisor, control_url: str) -> None:
    for status in supervisor.statuses():
        if status.state == State.READY:
            kv = status.kv_capacity or {}
            capacity = f"{kv['tokens']:,} tokens {kv['cache_dtype']}" if kv else "unknown"
            console.print(
                f"[green]ready[/green] {status.name}: {status.url}/v1 (pid {status.pid}, KV {capacity}, "
                f"warm-up {'none in the profile' if status.warmup_done is None else 'done'})"
            )
        else:
            console.print(f"[yellow]{status.state}[/yellow] {status.name}: {status.last_failure}")
    console.print(
        f"Control API: {control_url}/engines. Stop with Ctrl-C or `kill -TERM {os.getpid()}`.",
    )
    sys.stderr.flush()
