"""Run every command the documentation's guides show output for; write what each printed to docs/captured/.

`make docs-capture` runs it. Each scenario runs in a temporary folder holding a copy of the repo's deploy/
(and, for `kvtune plan`, a finished sweep's run folder, tools/docs_fixtures/), and each capture becomes
docs/captured/NAME.txt: the command line as a guide shows it, then what the command printed (stdout and
stderr, as a terminal shows them), for every command of that capture. Temporary paths, this checkout's
path, the home folder, ports and process ids are replaced by what a reader would see in a folder of their
own. Guides include them with `--8<-- "captured/NAME.txt"`: no output in the docs is typed by hand.

Scenarios marked `engine` start one vLLM CPU engine at a time through `kvtune up` (about 4 GB each) and stop
it through `kvtune up`'s own stop (SIGTERM), with every wait bounded. Every process started here is stopped
by its process group on the way out, whether a capture failed or Ctrl-C was pressed; the script then exits
non-zero naming the capture that failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from kvtune import documents, processes
from kvtune.credentials import looks_secret, value_looks_secret
from kvtune.engine import free_port, serves_model
from kvtune.files import write_atomic
from kvtune.stop_request import StopRequest, requested_by_signals

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "captured"
FIXTURES = REPO / "tools" / "docs_fixtures"
# A finished sweep of deploy/sweeps/cpu-quick.yaml (a fresh clone's, 2026-12-05, 2 AVX2 cores), trimmed to
# what `kvtune plan` reads: summary.json, best.yaml, values.yaml and the winner's trial record.
RUN = "cpu-quick-20261205-154501"

# The ports a guide shows; each is replaced by a free one when the command runs, and back in its output.
ENGINE_PORT = 8000
CONTROL_PORT = 8099
# The terminal width outputs are laid out for (Rich tables and log lines): wide enough for the doctor's lines.
COLUMNS = "100"
# How long an engine may take to serve: a CPU engine starts eager in about a minute on 2 cores.
ENGINE_READY_S = 600.0
# kvtune up stops its engines within their shutdown grace (the profile's shutdown_timeout + 10 s).
UP_STOP_GRACE_S = 90.0
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PIDS = re.compile(r"\b(pid|PID|process group|kill -TERM) \d+\b")


def say(line: str, stream: TextIO = sys.stdout) -> None:
    """Progress, as it happens (the script's own output, never a capture's)."""
    stream.write(line + "\n")
    stream.flush()


class CaptureFailed(RuntimeError):
    """A command did not do what the capture shows; str() says which and how."""


class Interrupted(RuntimeError):
    """Ctrl-C or SIGTERM asked the script to stop."""


# ---- what a scenario is made of ------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """COMMAND run in the scenario's folder, shown in capture SHOW (None: run, not shown).

    `hidden` flags are added when it runs but not shown (they move it off the ports a guide shows);
    `background` names a command left running until a Wait or Stop step with that key."""

    command: str
    show: str | None
    expect: tuple[int, ...] = (0,)
    timeout_s: float = 180.0
    hidden: tuple[str, ...] = ()
    background: str | None = None


@dataclass(frozen=True)
class Write:
    """A file the scenario's commands read, written into its folder; shown in SHOW under a comment."""

    path: str
    text: str | Callable[[Session], str]
    show: str | None = None


@dataclass(frozen=True)
class Ready:
    """Wait until the engine at URL serves a model, failing as soon as background command KEY has ended."""

    url: str
    key: str
    timeout_s: float = ENGINE_READY_S


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Wait:
    """Wait for background command KEY to end by itself; its output then joins its capture."""

    key: str
    timeout_s: float = 300.0


@dataclass(frozen=True)
class Stop:
    """Stop background command KEY as a user does (SIGTERM, Ctrl-C's twin); its output joins its capture."""

    key: str
    grace_s: float = UP_STOP_GRACE_S
    expect: tuple[int, ...] = (0,)


Step = Run | Write | Ready | Sleep | Wait | Stop


@dataclass(frozen=True)
class Scenario:
    """Steps run in one temporary folder, in order; `engine` when one of them starts a vLLM engine."""

    name: str
    steps: tuple[Step, ...]
    engine: bool = False
    run_folder: bool = False  # copy the finished sweep's run folder into runs/

    def commands(self) -> list[str]:
        """Every command line it shows, in order (what `--list` prints and a test parses)."""
        return [step.command for step in self.steps if isinstance(step, Run) and step.show]

    def captures(self) -> list[str]:
        """The capture files it writes, in order."""
        names = [step.show for step in self.steps if isinstance(step, Run | Write) and step.show]
        return list(dict.fromkeys(names))


# ---- normalising what was printed ----------------------------------------------------------------------


def normalise(text: str, replacements: Sequence[tuple[str, str]], ports: dict[int, int]) -> str:
    """TEXT as a capture keeps it: terminal codes removed, each (old, new) of REPLACEMENTS applied in order
    (longest paths first), each real port of PORTS (shown -> real) shown as the guide's, process ids as PID,
    trailing spaces cut and one final newline."""
    text = _ANSI.sub("", text).replace("\r\n", "\n")
    for old, new in replacements:
        if old:
            text = text.replace(old, new)
    for shown, real in ports.items():
        text = re.sub(_number(real), str(shown), text)
    text = _PIDS.sub(lambda match: f"{match[1]} PID", text)
    lines = [line.rstrip() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines) + "\n" if lines else ""


def with_real_ports(text: str, ports: dict[int, int]) -> str:
    """TEXT (a command line, a profile) with each port a guide shows replaced by the one this run uses."""
    for shown, real in ports.items():
        text = re.sub(_number(shown), str(real), text)
    return text


def _number(port: int) -> str:
    """PORT as a whole number (in a URL, a flag's value, a YAML field), not a part of another."""
    return rf"(?<![\w.]){port}(?![\w.])"


def path_replacements(folder: Path) -> list[tuple[str, str]]:
    """Where this run's paths are shown from: the scenario's folder as the current folder, this checkout as
    the repo's root (the virtualenv, the package), the home folder as ~."""
    pairs = []
    for path in dict.fromkeys((folder, folder.resolve())):
        pairs += [(f"{path}/", ""), (str(path), ".")]
    pairs += [(f"{REPO}/", ""), (str(Path.home()), "~")]
    return pairs


def secret_lines(text: str) -> list[int]:
    """Line numbers (1-based) of TEXT holding a value in a credential's form: a capture must hold none."""
    return [number for number, line in enumerate(text.splitlines(), 1) if value_looks_secret(line)]


# What tells a command line from output in a capture (and lets a test find every command the docs show).
PROMPT = "$ "


@dataclass(frozen=True)
class Shown:
    """One piece of a capture: a command line and what it printed, or (command None) a file it read."""

    command: str | None
    output: str

    def text(self) -> str:
        return self.output if self.command is None else f"{PROMPT}{self.command}\n{self.output}"


def capture_text(entries: Sequence[Shown]) -> str:
    """A capture file: each command line after the prompt, then its output, in the order they ran."""
    return "".join(entry.text() for entry in entries)


def command_env() -> dict[str, str]:
    """The environment commands run in: this one without any credential (nothing secret can be printed),
    laid out for a fixed terminal width and without colour."""
    keep = {k: v for k, v in os.environ.items() if not looks_secret(k) and not k.startswith("KVTUNE_API")}
    return keep | {"COLUMNS": COLUMNS, "NO_COLOR": "1", "TERM": "dumb", "PYTHONUNBUFFERED": "1"}


# ---- running a scenario --------------------------------------------------------------------------------


@dataclass
class Background:
    proc: subprocess.Popen[bytes]
    command: str
    show: str | None
    output: Path
    expect: tuple[int, ...]


@dataclass
class Session:
    """One scenario's folder, ports and processes, and what its commands printed so far."""

    name: str
    folder: Path
    stop: StopRequest
    ports: dict[int, int]
    captured: dict[str, list[Shown]] = field(default_factory=dict)
    running: dict[str, Background] = field(default_factory=dict)
    # The process groups `kvtune up` started its engines in (sessions of their own): stopped here too, should
    # `kvtune up` itself have to be killed before it could stop them.
    engine_groups: set[int] = field(default_factory=set)
    logs: Path = field(init=False)
    replacements: list[tuple[str, str]] = field(init=False)

    def __post_init__(self) -> None:
        self.logs = Path(tempfile.mkdtemp(prefix="kvtune-docs-output-"))
        self.replacements = path_replacements(self.folder)

    def output(self, capture: str) -> str:
        """What the commands of capture CAPTURE printed so far (for a later step that reads advice off it)."""
        return "".join(entry.output for entry in self.captured.get(capture, []))

    def real(self, text: str) -> str:
        return with_real_ports(text, self.ports)

    def argv(self, step: Run) -> list[str]:
        words = shlex.split(self.real(step.command)) + [self.real(word) for word in step.hidden]
        if words[0] == "kvtune":  # this checkout's kvtune, whatever is on PATH
            words = [sys.executable, "-m", "kvtune.cli", *words[1:]]
        return words

    def record(self, show: str | None, command: str, raw: str) -> None:
        if show is not None:
            text = normalise(raw, self.replacements, self.ports)
            self.captured.setdefault(show, []).append(Shown(command, text))

    def check_stop(self) -> None:
        if self.stop.is_set():
            raise Interrupted(f"stopped by {self.stop.describe()}")

    def start(self, step: Run) -> Background:
        output = self.logs / f"{len(list(self.logs.iterdir())):02d}.out"
        with output.open("wb") as sink:
            # A session of its own: its process group (Locust's workers, an engine's API server) ends with it.
            proc = subprocess.Popen(
                self.argv(step),
                cwd=self.folder,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=command_env(),
                start_new_session=True,
            )
        return Background(proc, step.command, step.show, output, step.expect)

    def finish(self, job: Background, timeout_s: float) -> None:
        """Wait up to TIMEOUT_S for JOB to end by itself; record its output; CaptureFailed on a wrong exit."""
        deadline = time.monotonic() + timeout_s
        try:
            while job.proc.poll() is None:
                self.check_stop()
                if time.monotonic() >= deadline:
                    raise CaptureFailed(f"`{job.command}` still ran after {timeout_s:.0f} s; stopped it")
                time.sleep(0.2)
        finally:  # ended, given up or interrupted: nothing of its group outlives the wait
            processes.stop_group(job.proc, UP_STOP_GRACE_S)
        self.settle(job)

    def settle(self, job: Background) -> None:
        raw = documents.read_text(job.output, "a command's output")
        code = job.proc.returncode
        if code not in job.expect:
            tail = "\n".join(raw.strip().splitlines()[-15:])
            wanted = " or ".join(map(str, job.expect))
            raise CaptureFailed(f"`{job.command}` exited {code}, not {wanted}; its last lines:\n{tail}")
        self.record(job.show, job.command, raw)

    def run(self, step: Run) -> None:
        job = self.start(step)
        if step.background is not None:
            self.running[step.background] = job
            return
        self.finish(job, step.timeout_s)

    def write(self, step: Write) -> None:
        text = step.text(self) if callable(step.text) else step.text
        path = self.folder / step.path
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, self.real(text))
        if step.show is not None:
            self.captured.setdefault(step.show, []).append(Shown(None, f"# {step.path}\n{text}"))

    def ready(self, step: Ready) -> None:
        job = self.running[step.key]
        deadline = time.monotonic() + step.timeout_s
        url = self.real(step.url)
        while not _serves(url):
            self.check_stop()
            if job.proc.poll() is not None:
                self.running.pop(step.key)
                tail = "\n".join(documents.read_text(job.output, "a command's output").splitlines()[-15:])
                raise CaptureFailed(
                    f"`{job.command}` exited {job.proc.returncode} before {url} served:\n{tail}"
                )
            if time.monotonic() >= deadline:
                raise CaptureFailed(f"{url} did not serve within {step.timeout_s:.0f} s of `{job.command}`")
            time.sleep(1.0)
        self.engine_groups |= processes.child_groups(job.proc.pid)

    def wait(self, step: Wait) -> None:
        self.finish(self.running.pop(step.key), step.timeout_s)

    def stop_job(self, step: Stop) -> None:
        job = self.running.pop(step.key)
        job.expect = step.expect
        processes.stop_group(job.proc, step.grace_s)
        self.stop_engines()
        self.settle(job)

    def stop_engines(self) -> None:
        """End what is left of the engines' groups (nothing, when `kvtune up` stopped them as it should)."""
        for group in sorted(self.engine_groups):
            if processes.group_members(group):
                say(f"  engine group {group} outlived kvtune up: stopping it")
                processes.end_group(group, 30.0)
        self.engine_groups.clear()

    def close(self) -> None:
        """Stop whatever still runs, newest first (a load before the engine it loads)."""
        for key in reversed(list(self.running)):
            job = self.running.pop(key)
            say(f"  stopping `{job.command}` (pid {job.proc.pid})")
            processes.stop_group(job.proc, UP_STOP_GRACE_S)
        self.stop_engines()
        shutil.rmtree(self.logs, ignore_errors=True)


def _serves(url: str) -> bool:
    """The engine at URL answers /health and lists a model."""
    with httpx.Client(base_url=url, timeout=5.0) as client:
        return serves_model(client)


def run_scenario(scenario: Scenario, stop: StopRequest, keep: bool = False) -> dict[str, str]:
    """Each capture of SCENARIO as its file's text; CaptureFailed or Interrupted with everything stopped."""
    folder = Path(tempfile.mkdtemp(prefix=f"kvtune-docs-{scenario.name}-"))
    shutil.copytree(REPO / "deploy", folder / "deploy")
    if scenario.run_folder:
        shutil.copytree(FIXTURES / RUN, folder / "runs" / RUN)
    ports = {ENGINE_PORT: free_port(), CONTROL_PORT: free_port()} if scenario.engine else {}
    session = Session(scenario.name, folder, stop, ports)
    try:
        for step in scenario.steps:
            session.check_stop()
            if isinstance(step, Run):
                label = "started" if step.background else "running"
                say(f"  {label}: {step.command}")
                session.run(step)
            elif isinstance(step, Write):
                session.write(step)
            elif isinstance(step, Ready):
                say(f"  waiting for {step.url} to serve (at most {step.timeout_s:.0f} s)")
                session.ready(step)
            elif isinstance(step, Sleep):
                if stop.wait(step.seconds):
                    session.check_stop()
            elif isinstance(step, Wait):
                session.wait(step)
            else:
                say(f"  stopping: {session.running[step.key].command}")
                session.stop_job(step)
    finally:
        session.close()
        if keep:
            say(f"  kept {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    files = {name: capture_text(entries) for name, entries in session.captured.items()}
    for name, text in files.items():
        if lines := secret_lines(text):
            raise CaptureFailed(
                f"{name}: lines {lines} hold a value in a credential's form; nothing is written"
            )
    return files


# ---- the scenarios -------------------------------------------------------------------------------------

# The engine a guide diagnoses: the embedded model on vLLM's CPU build with a pool of 16 blocks of 32 tokens
# (the block cap sizes it; 1 GiB would hold far more), eager so that it starts in about a minute, with vLLM's
# block residency histograms on for every block. The trace's longest request (64 + 3 x 40 + 32 prompt tokens,
# 8 out) fits max_model_len 256, which the smallest pool must hold.
POOL_PROFILE = """\
name: {name}
device: cpu
model: smollm2-135m
host: 127.0.0.1
port: 8000
max_model_len: 256
dtype: float32
kv_cache_memory_bytes: 1GiB
num_gpu_blocks_override: {blocks}
block_size: 32
enable_prefix_caching: true
enforce_eager: true
kv_cache_metrics: true
kv_cache_metrics_sample: 1.0
cpu_reserved_cores: 0
ready_timeout_s: 600
"""
SMALL_BLOCKS = 16
# One trial slot more than this process may use cores: what `--parallel` refuses here.
TOO_MANY_SLOTS = len(os.sched_getaffinity(0)) + 1
# The doctor's exit codes that are verdicts (0 healthy, 1 unhealthy): which one a pool earns is what it shows.
VERDICTS = (0, 1)
_ADVICE = re.compile(r"num_gpu_blocks_override: ([\d,]+)")


def advised_blocks(session: Session) -> int:
    """The pool `kvtune trace curve` recommended for the small pool's profile (its `set one of` line)."""
    found = _ADVICE.search(session.output("trace-curve-small-pool"))
    if found is None:
        raise CaptureFailed("trace-curve-small-pool: no `num_gpu_blocks_override: N` recommendation printed")
    return int(found[1].replace(",", ""))


def fixed_profile(session: Session) -> str:
    return POOL_PROFILE.format(name="fixed-pool", blocks=advised_blocks(session))


def fleet_profile(_session: Session) -> str:
    """The shipped CPU profile, renamed, with two replicas that publish KV events (the routing guide's)."""
    text = documents.read_text(REPO / "deploy" / "profiles" / "cpu-smollm2.yaml", "an engine profile")
    text = re.sub(r"(?m)^name: .*$", "name: fleet", text)
    return text + "replicas: 2\nkv_events_port: 5557\n"


# 99 requests of 40 chats over 6 shared system prompts: replayed one at a time in about a minute, and reusing
# more than 16 blocks can keep (the curve's target is about 4x that).
TRACE = "kvtune trace generate -o chat.jsonl --conversations 40 --system-prompts 6 --system-tokens 64 "
TRACE += "--turns 4 --user-tokens 32 --output-tokens 8 --block-size 32 --think-s 20 --seed 0"
REPLAY = "kvtune load --url http://127.0.0.1:8000 --workload trace --arg trace-file=chat.jsonl "
REPLAY += "--arrival closed --users 1"
DOCTOR = "kvtune doctor http://127.0.0.1:8000 --window 40"


def _engine_steps(pool: str) -> tuple[Step, ...]:
    """Serve POOL.yaml, replay the trace through it, and run the doctor (without and with the trace) over a
    window inside the replay; then stop the engine as a user would."""
    up = f"kvtune up {pool}.yaml"
    return (
        Run(
            up,
            show=f"{pool}-up" if pool == "small-pool" else None,
            hidden=("--control-port", "8099"),
            background="up",
        ),
        Ready("http://127.0.0.1:8000", key="up"),
        Run(REPLAY, show=f"{pool}-load", background="load", timeout_s=600),
        Sleep(10),
        Run(DOCTOR, show=f"{pool}-doctor", expect=VERDICTS, background="doctor"),
        Run(
            f"{DOCTOR} --trace chat.jsonl",
            show=f"{pool}-doctor-trace",
            expect=VERDICTS,
            timeout_s=120,
        ),
        Wait("doctor", timeout_s=120),
        Wait("load", timeout_s=600),
        Stop("up"),
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "render",
        (
            Run("kvtune render deploy/profiles/cpu-smollm2.yaml", show="render-cpu"),
            Run(
                "kvtune render deploy/profiles/gpu-llama31-8b-h100.yaml --as helm-values",
                show="render-helm-values",
            ),
        ),
    ),
    Scenario(
        "sweep-dry-run",
        (
            Run("kvtune sweep deploy/sweeps/cpu-quick.yaml --dry-run", show="sweep-dry-run"),
            Run("kvtune sweep deploy/sweeps/cpu-full.yaml --dry-run --parallel 2", show="sweep-parallel"),
            # One slot more than this host has cores: refused, naming what is there.
            Run(
                f"kvtune sweep deploy/sweeps/cpu-full.yaml --dry-run --parallel {TOO_MANY_SLOTS}",
                show="sweep-parallel",
                expect=(2,),
            ),
            Run(
                "kvtune sweep deploy/sweeps/cpu-quick.yaml --dry-run --parallel 2",
                show="sweep-parallel",
                expect=(2,),
            ),
        ),
    ),
    Scenario(
        "trace",
        (
            Run(
                "kvtune trace generate -o chat.jsonl --conversations 200 --block-size 128", show="trace-curve"
            ),
            Run(
                "kvtune trace curve chat.jsonl --profile deploy/profiles/cpu-smollm2.yaml --in-flight 4 "
                "--out curve/",
                show="trace-curve",
            ),
            Write(
                "requests.jsonl",
                '{"timestamp": 0, "messages": [{"role": "system", "content": "You answer in French."}, '
                '{"role": "user", "content": "Where is the Louvre?"}], "max_tokens": 32}\n'
                '{"timestamp": 1500, "messages": [{"role": "system", "content": "You answer in French."}, '
                '{"role": "user", "content": "And the Orsay museum?"}], "max_tokens": 32}\n'
                '{"timestamp": 4000, "prompt": "Translate to French: good morning", "output_tokens": 8}\n',
                show="trace-convert",
            ),
            Run(
                "kvtune trace convert requests.jsonl -o trace.jsonl --model deploy/profiles/cpu-smollm2.yaml",
                show="trace-convert",
            ),
        ),
    ),
    Scenario(
        "plan",
        (
            Run(f"kvtune plan runs/{RUN} --peak-rate 4 --min-rate 1", show="plan"),
            Run(f"cat runs/{RUN}/values-plan.yaml", show="plan"),
            Run(f"kvtune plan runs/{RUN} --peak-rate 4 --min-rate 5", show="plan-refused", expect=(2,)),
        ),
        run_folder=True,
    ),
    Scenario(
        "router-ports",
        (
            Write("fleet.yaml", fleet_profile),
            Run("kvtune up fleet.yaml --router-port 8001", show="up-port-clash", expect=(2,)),
        ),
    ),
    Scenario(
        "pool",
        (
            Run(TRACE, show="trace-small-pool"),
            Write(
                "small-pool.yaml",
                POOL_PROFILE.format(name="small-pool", blocks=SMALL_BLOCKS),
                "small-pool-profile",
            ),
            Run("kvtune trace curve chat.jsonl --profile small-pool.yaml", show="trace-curve-small-pool"),
            *_engine_steps("small-pool"),
            Write("fixed-pool.yaml", fixed_profile, show="fixed-pool-profile"),
            *_engine_steps("fixed-pool"),
        ),
        engine=True,
    ),
)


# ---- the command ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    names = [scenario.name for scenario in SCENARIOS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument(
        "scenarios", nargs="*", metavar="SCENARIO", help=f"some of: {', '.join(names)} (default all)"
    )
    parser.add_argument(
        "--list", action="store_true", help="print each scenario's commands and captures, run nothing"
    )
    parser.add_argument(
        "--no-engines", action="store_true", help="skip the scenarios that start a vLLM engine"
    )
    parser.add_argument("--keep", action="store_true", help="keep each scenario's temporary folder")
    parser.add_argument("--out", type=Path, default=OUT, help="where the captures go (default docs/captured)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.scenarios if name not in names]
    if unknown:
        parser.error(f"no scenario {', '.join(unknown)}; choose from {', '.join(names)}")
    return args


def chosen(args: argparse.Namespace) -> list[Scenario]:
    picked = [s for s in SCENARIOS if not args.scenarios or s.name in args.scenarios]
    return [s for s in picked if not (args.no_engines and s.engine)]


def listing(scenarios: Sequence[Scenario]) -> str:
    lines = []
    for scenario in scenarios:
        lines.append(f"{scenario.name}{' (starts a vLLM engine)' if scenario.engine else ''}:")
        lines += [f"  {command}" for command in scenario.commands()]
        lines.append(f"  -> {', '.join(f'{name}.txt' for name in scenario.captures())}")
    return "\n".join(lines)


@contextmanager
def _timed(label: str) -> Iterator[None]:
    began = time.monotonic()
    yield
    say(f"{label}: {time.monotonic() - began:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    scenarios = chosen(args)
    if args.list:
        say(listing(scenarios))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with requested_by_signals() as stop:
        for index, scenario in enumerate(scenarios, 1):
            say(f"[{index}/{len(scenarios)}] {scenario.name}")
            try:
                with _timed(f"[{index}/{len(scenarios)}] {scenario.name}"):
                    files = run_scenario(scenario, stop, keep=args.keep)
            except CaptureFailed as exc:
                say(f"capture {scenario.name} failed: {exc}", sys.stderr)
                return 1
            except Interrupted as exc:
                say(
                    f"capture {scenario.name} interrupted ({exc}); every process it started is stopped",
                    sys.stderr,
                )
                return 128 + (stop.signum or signal.SIGINT)
            for name, text in files.items():
                write_atomic(args.out / f"{name}.txt", text)
                say(f"  wrote {args.out / name}.txt")
    say(f"captured {len(scenarios)} scenarios in {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
