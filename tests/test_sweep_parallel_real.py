"""`kvtune sweep SPEC --parallel 2` on real engines: two trials at once, each engine (and its worker and
load generator) on its own core of this 2-core host, on its own port; then one worker dies with its engine
mid-trial (SIGKILL: a lost host) and the other measures that config again; one report names each config's
worker and says how the cores were split.

What is asserted is the placement (the processes' own CPU affinity, read while both engines run) and the
bookkeeping, not how fast either trial served: on one core each the rates are per share of the host.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from kvtune.platform import format_core_ids
from kvtune.sweep.study import SharedStudy, open_storage
from tests.helpers import write_test_profile
from tests.test_sweep_real import processes_mentioning, sweep, wait_for

pytestmark = pytest.mark.engine

SPEC: dict[str, Any] = {
    "name": "parallel",
    "space": {"max_num_seqs": [2, 4], "max_model_len": [384]},
    "envelope": {"max_model_len": 384},
    "validation": {"enabled": False},  # validation runs alone afterwards; tests/test_validation_real.py
    "quality": {"enabled": False},
    "drift_check": False,
    "workload": {
        "name": "shared_prefix",
        "args": {"system-tokens": 100, "user-tokens": 20},
        "max_tokens": 16,
        "users": 2,
    },
    "slo": {"ttft_p50_s": 10.0, "max_error_rate": 0.5},
    "load": {
        "start_rate": 0.5,
        "max_rate": 0.5,
        "rate_cap": 0.5,  # one rate: the test is about workers, not the ladder
        "bisect_steps": 0,
        "step_seconds": 12,
        "warmup_seconds": 1,
        "max_step_seconds": 24,
        "confirm_goodput": False,  # the search's second look: tests/test_sweep_real.py
    },
}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _engines_of(workers: list[psutil.Process]) -> dict[int, psutil.Process]:
    """Each worker's vLLM server process (by the worker's pid), once it has started one."""
    found = {}
    for worker in workers:
        for child in worker.children(recursive=True):
            try:
                if "vllm.entrypoints" in " ".join(child.cmdline()):
                    found[worker.pid] = child
                    break
            except psutil.NoSuchProcess:
                continue
    return found


def test_two_trials_at_once_on_disjoint_cores_and_a_lost_worker_s_config_measured_again(
    tmp_path: Path,
) -> None:
    # A base profile bound to one core of the host: each trial's engine is placed on its worker's core
    # instead, and the worker pinned to core 1 still reads the profile that names core 0.
    first_core = str(min(os.sched_getaffinity(0)))
    write_test_profile(tmp_path / "base.yaml", cpu_threads_bind=first_core, cpu_reserved_cores=None)
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(SPEC | {"base_profile": "base.yaml"}))
    runs, log = tmp_path / "runs", tmp_path / "sweep.log"
    runs.mkdir()
    proc = sweep(str(spec), "--parallel", "2", "--runs-dir", str(runs), log=log)
    try:
        workers: list[psutil.Process] = []

        def both_engines_up() -> bool:
            nonlocal workers
            workers = [p for p in processes_mentioning("--devices") if p.ppid() == proc.pid]
            return len(workers) == 2 and len(_engines_of(workers)) == 2

        wait_for(both_engines_up, proc, log, 600, "two trial engines running at once")
        engines = _engines_of(workers)
        affinities = {pid: frozenset(engine.cpu_affinity()) for pid, engine in engines.items()}
        own = {worker.pid: frozenset(worker.cpu_affinity()) for worker in workers}
        assert affinities == own, "each engine computes on its worker's cores"
        first, second = affinities.values()
        assert first and second and not first & second, f"the engines share cores: {affinities}"
        ports = {_flag(engine.cmdline(), "--port") for engine in engines.values()}
        assert len(ports) == 2, f"each engine on its own port: {ports}"
        # A lost host: the first worker and its engine die mid-trial, without a word to the study.
        doomed, survivor = workers
        lost = [doomed, *doomed.children(recursive=True), *engines[doomed.pid].children(recursive=True)]
        for victim in lost:
            with contextlib.suppress(psutil.NoSuchProcess):
                victim.kill()
        psutil.wait_procs(lost, timeout=30)
        code = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert code in (0, 1), log.read_text()[-3000:]  # 1: no config met the SLO on one core (host speed)
    assert "exited" not in log.read_text().replace("exited -9", ""), "only the killed worker broke"
    (run,) = [p for p in runs.iterdir() if p.name.startswith("parallel-2") and not p.is_symlink()]
    records = SharedStudy.join(open_storage(str(run / "study.journal")), "parallel")[0].records()
    assert len(records) == 2 and len({r.config_id for r in records}) == 2, "each config measured once"
    assert {r.worker for r in records} == {f"{os.uname().nodename}:{survivor.pid}"}, (
        "the lost worker's config was measured again by the other"
    )
    assert {r.devices for r in records} == {f"cores {format_core_ids(affinities[survivor.pid])}"}
    report = (run / "report.md").read_text()
    assert "| Worker |" in report and "trials ran 2 at a time" in " ".join(report.split())
