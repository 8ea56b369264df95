"""One sweep measured by several workers: its configs claimed through one Optuna study in shared storage.

Every claim of a config is an Optuna trial, asked (RUNNING) by the worker that measures the config, with the
config's id and the worker in its system attributes (kvtune's bookkeeping; the user attributes are the
figures optuna-dashboard shows), and told COMPLETE with the measured records. Two workers
that claim the same config at once both see both claims once their attributes are written: the lower trial
number keeps it, the other gives its claim up (FAIL, marked superseded) and draws another config, so no
config is measured twice. A worker that dies leaves its claim RUNNING: with an RDB storage Optuna's heartbeat
fails it after the grace period; a journal file (Optuna keeps no heartbeat there) fails a claim whose worker
process is gone from this host. Either way the config is free again. A config vLLM refused is a COMPLETE
claim whose records say so: it stays refused.

Storage is Optuna's own: a journal file (one host, or a shared filesystem) or an RDB URL such as
postgresql://user@host/db, whose password libpq reads from PGPASSWORD (kvtune.sweep.storage judges, shows
and opens it). Other hosts write it, so what it holds is checked before use: study names by the one name
rule (they name run folders), records by their config ids, text shown on the console by its characters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import BaseStorage, RDBStorage
from optuna.trial import FrozenTrial, TrialState
from pydantic import ValidationError

from kvtune.config_errors import ConfigError
from kvtune.documents import read_text
from kvtune.files import name_problem
from kvtune.sweep import run_dir
from kvtune.sweep import storage as storage_module
from kvtune.sweep.records import TrialRecord, ValidationSummary, config_id, describe
from kvtune.sweep.shown_step import representative, telling_step
from kvtune.sweep.spec import SweepSpec
from kvtune.sweep.storage import shown_url as shown_url  # where callers have always found it

# Seconds between a worker's heartbeats, and how long a silent claim lives before another worker fails it
# (an RDB storage): a trial's engine start alone takes minutes, so a minute of silence is a dead worker.
HEARTBEAT_S = 10
GRACE_S = 60

_CONFIG = "kvtune_config_id"
_KNOBS = "kvtune_knobs"
_WORKER = "kvtune_worker"
_RECORDS = "kvtune_records"
_SUPERSEDED = "kvtune_superseded"
_SPEC = "kvtune_spec"
PROGRESS = "progress"
# The claim that validates the winner: one per study, taken by the first worker to find the search done.
_VALIDATION = "__validation__"
_VALIDATED = "kvtune_validation"  # the validation claim's verdict


@dataclass(frozen=True)
class Worker:
    """Who measures a claim: the host and process, shown in the report beside each trial."""

    host: str
    pid: int

    @property
    def name(self) -> str:
        return f"{self.host}:{self.pid}"

    @classmethod
    def this_process(cls) -> Worker:
        return cls(socket.gethostname(), os.getpid())


def open_storage(url: str, *, read_only: bool = False) -> BaseStorage:
    """Optuna's storage at URL (kvtune.sweep.storage.open_storage), with this module's heartbeat: a journal
    file path or an RDB URL; READ_ONLY (a dry run) creates and writes nothing."""
    return storage_module.open_storage(url, read_only=read_only, heartbeat_s=HEARTBEAT_S, grace_s=GRACE_S)


def study_name_problem(name: str) -> str | None:
    """Why NAME cannot name a study: it names run folders and their `-latest` link (kvtune.files' rule)."""
    return name_problem(name)


def _checked_name(name: str, flag: str) -> str:
    problem = study_name_problem(name)
    if problem:
        raise ConfigError(f"{flag}: {problem}")
    return name


def shown_text(text: object, limit: int = 200) -> str:
    """Text read from the shared storage (a worker's name, a progress note) as it may be printed: printable
    characters only (no terminal escapes), at most LIMIT of them."""
    cleaned = "".join(char if char.isprintable() else "?" for char in str(text)[:limit])
    return cleaned if len(str(text)) <= limit else cleaned + "..."


def spec_differences(stored: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The spec's top-level fields whose values differ between a study's spec and this one."""
    return [key for key in sorted(set(stored) | set(ours)) if stored.get(key) != ours.get(key)]


@dataclass(frozen=True)
class StoredSpec:
    """A sweep's spec as its study keeps it: the run folder's spec.yaml and base profile texts (a worker that
    joins writes them into its own run folder), and what two workers' specs are compared by."""

    spec_yaml: str
    base_profile: str
    fingerprint: dict[str, Any]

    def as_attr(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def of(cls, spec: SweepSpec, path: Path) -> StoredSpec:
        """SPEC (read from PATH) as its study keeps it."""
        base = read_text(spec.base_profile)
        return cls(run_dir.run_spec_yaml(spec, path), base, fingerprint(spec.model_dump(mode="json"), base))


def fingerprint(spec_dump: dict[str, Any], base_profile_text: str) -> dict[str, Any]:
    """What makes two specs the same sweep: every field but the base profile's path, and that profile's text
    (a JSON round trip, so what comes back from the storage compares equal)."""
    fields = {key: value for key, value in spec_dump.items() if key != "base_profile"}
    loaded: dict[str, Any] = json.loads(json.dumps(fields | {"base_profile": base_profile_text}, default=str))
    return loaded


@dataclass
class Claim:
    """A config this worker holds in the study while it measures it."""

    trial_id: int
    number: int
    knobs: dict[str, Any]


class SharedStudy:
    """A sweep's study: which configs are measured or being measured, by whom, and their records."""

    def __init__(self, storage: BaseStorage, study: optuna.Study, worker: Worker) -> None:
        self.storage = storage
        self.study = study
        self.worker = worker
        # How often a worker with nothing left to claim looks again while others measure.
        self.poll_s = float(HEARTBEAT_S)
        self._current: Claim | None = None  # the config this worker measures now
        self._noted_at = 0.0

    @property
    def name(self) -> str:
        return self.study.study_name

    # ---- opening ---------------------------------------------------------------------------------------

    @classmethod
    def create_or_join(cls, storage: BaseStorage, name: str, spec: StoredSpec) -> SharedStudy:
        """The study NAME holding SPEC: created when new; joined when it holds the same spec; ConfigError
        naming the fields that differ when it holds another, or when NAME breaks the name rule."""
        _checked_name(name, "--study")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        cls.preview(storage, name, spec)  # another spec is refused before anything is written
        study = optuna.create_study(
            study_name=name, storage=storage, direction="maximize", load_if_exists=True
        )
        stored = storage.get_study_system_attrs(study._study_id).get(_SPEC)
        if stored is None:
            storage.set_study_system_attr(study._study_id, _SPEC, spec.as_attr())
        else:
            _check_same_spec(name, stored, spec)  # another worker created it meanwhile
        return cls(storage, study, Worker.this_process())

    @staticmethod
    def preview(storage: BaseStorage, name: str, spec: StoredSpec) -> str:
        """What `create_or_join` would do, read without writing (a dry run): "new" when the study NAME is not
        there, "exists" when it holds SPEC; ConfigError when it holds another spec."""
        _checked_name(name, "--study")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            study_id = storage.get_study_id_from_name(name)
        except KeyError:
            return "new"
        stored = storage.get_study_system_attrs(study_id).get(_SPEC)
        if stored is not None:
            _check_same_spec(name, stored, spec)
        return "exists"

    @classmethod
    def join(cls, storage: BaseStorage, name: str) -> tuple[SharedStudy, StoredSpec]:
        """The existing study NAME and the spec it holds; ConfigError listing the studies there otherwise.
        Reads only. What the storage holds is untrusted (other hosts write it): names breaking the name rule
        are not listed, and a spec that is not text is refused."""
        _checked_name(name, "--join")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        names = [study.study_name for study in storage.get_all_studies()]
        if name not in names:
            usable = sorted(there for there in names if study_name_problem(there) is None)
            listed = ", ".join(usable[:20]) + (f" and {len(usable) - 20} more" if len(usable) > 20 else "")
            others = len(names) - len(usable)
            listed += (
                f"{', and ' if usable else ''}{others} named against kvtune's name rule" if others else ""
            )
            raise ConfigError(
                f"--join {name}: no such study in this storage (studies there: {listed or 'none'})"
            )
        study = optuna.load_study(study_name=name, storage=storage)
        stored = storage.get_study_system_attrs(study._study_id).get(_SPEC)
        texts = ("spec_yaml", "base_profile")
        if (
            not isinstance(stored, dict)
            or not all(isinstance(stored.get(key), str) for key in texts)
            or not isinstance(stored.get("fingerprint"), dict)
        ):
            raise ConfigError(f"--join {name}: the study was not made by `kvtune sweep` (it holds no spec)")
        spec = StoredSpec(stored["spec_yaml"], stored["base_profile"], stored["fingerprint"])
        return cls(storage, study, Worker.this_process()), spec

    # ---- claims ----------------------------------------------------------------------------------------

    def _live_claims(self) -> list[FrozenTrial]:
        """Claims that hold their config: measured, or being measured by a live worker (dead ones failed)."""
        self._fail_dead_claims()
        trials = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.COMPLETE))
        return [trial for trial in trials if _CONFIG in trial.system_attrs]

    def _fail_dead_claims(self) -> None:
        with warnings.catch_warnings():  # experimental, as above
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(self.study)  # RDB storages: Optuna's heartbeat
        if isinstance(self.storage, RDBStorage):
            return
        here = self.worker.host
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            owner = trial.system_attrs.get(_WORKER)
            if isinstance(owner, dict) and owner.get("host") == here and not _alive(int(owner["pid"])):
                self._give_up(trial._trial_id, superseded=False)

    def holders(self) -> dict[str, FrozenTrial]:
        """Each claimed config's id and the claim that holds it (the lowest trial number)."""
        holders: dict[str, FrozenTrial] = {}
        for trial in sorted(self._live_claims(), key=lambda t: t.number):
            holders.setdefault(str(trial.system_attrs[_CONFIG]), trial)
        return holders

    def claimed_configs(self) -> int:
        """Configs measured or being measured across the study: what `budget.trials` counts."""
        return sum(1 for key in self.holders() if key != _VALIDATION)

    def claim(self, knobs: dict[str, Any]) -> Claim | None:
        """KNOBS claimed for this worker; None when another worker holds it (measured, or measuring)."""
        key = config_id(knobs) if knobs else _VALIDATION
        if key in self.holders():
            return None
        trial = self.study.ask()
        self.storage.set_trial_system_attr(trial._trial_id, _CONFIG, key)
        self.storage.set_trial_system_attr(trial._trial_id, _KNOBS, knobs)
        owner: dict[str, Any] = {"host": self.worker.host, "pid": self.worker.pid, "name": self.worker.name}
        self.storage.set_trial_system_attr(trial._trial_id, _WORKER, owner)
        trial.set_user_attr("worker", self.worker.name)  # shown while the config is measured
        holder = self.holders().get(key)
        if holder is None or holder.number != trial.number:  # another claim came first
            self._give_up(trial._trial_id, superseded=True)
            return None
        self._current = Claim(trial._trial_id, trial.number, dict(knobs))
        return self._current

    def claim_validation(self) -> Claim | None:
        """The one validation of the study's winner, for this worker; None when another took it."""
        return self.claim({})

    @contextmanager
    def heartbeat(self, claim: Claim) -> Iterator[None]:
        """Beats for CLAIM while its config is measured (an RDB storage: Optuna's heartbeat table)."""
        storage = self.storage
        if not isinstance(storage, RDBStorage):  # a journal file: the worker's process is its liveness
            yield
            return
        stop = threading.Event()

        def beat() -> None:
            while True:
                storage.record_heartbeat(claim.trial_id)
                if stop.wait(HEARTBEAT_S):
                    return

        thread = threading.Thread(target=beat, name=f"heartbeat-{claim.number}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def finish(self, claim: Claim, records: list[TrialRecord], goodput: float | None) -> None:
        """CLAIM measured: its records kept in the study (what `--collect` and the report read), and its
        figures as attributes optuna-dashboard shows beside the trial."""
        self._current = None
        dumped = [record.model_dump(mode="json") for record in records]
        self.storage.set_trial_system_attr(claim.trial_id, _RECORDS, dumped)
        for name, value in dashboard_attrs(records, goodput).items():
            self.storage.set_trial_user_attr(claim.trial_id, name, value)
        self.study.tell(claim.number, goodput or 0.0)

    def finish_validation(self, claim: Claim, validation: ValidationSummary) -> None:
        """The winner validated: its verdict kept in the study, for every report written after."""
        self.storage.set_trial_system_attr(claim.trial_id, _VALIDATED, validation.model_dump(mode="json"))
        self.study.tell(claim.number, 1.0 if validation.winner_passed else 0.0)

    def validation(self) -> ValidationSummary | None:
        """The study's validation of its winner, once a worker finished it; else None."""
        holder = self.holders().get(_VALIDATION)
        if holder is None or holder.state != TrialState.COMPLETE:
            return None
        return ValidationSummary.model_validate(holder.system_attrs[_VALIDATED])

    def release(self, claim: Claim) -> None:
        """CLAIM given up unmeasured (this worker was interrupted): another worker may measure it."""
        self._current = None
        self._give_up(claim.trial_id, superseded=False)

    def note(self, line: str, *, every_s: float = 2.0) -> None:
        """What this worker's trial is doing (its step, its rate), for whoever watches the study; at most
        once per EVERY_S seconds (each note is a write to the storage)."""
        now = time.monotonic()
        if self._current is None or now - self._noted_at < every_s:
            return
        self._noted_at = now
        self.storage.set_trial_user_attr(self._current.trial_id, PROGRESS, line)

    def running(self) -> list[tuple[str, str, str]]:
        """Each config being measured now: its worker, its knobs described, and its latest progress note."""
        rows = []
        for key, trial in self.holders().items():
            if key == _VALIDATION or trial.state != TrialState.RUNNING:
                continue
            owner = trial.system_attrs.get(_WORKER)
            worker = owner.get("name", "?") if isinstance(owner, dict) else "?"
            knobs = trial.system_attrs.get(_KNOBS)
            described = describe(knobs) if isinstance(knobs, dict) else "?"
            note = trial.user_attrs.get(PROGRESS, "starting")
            rows.append((shown_text(worker, 80), shown_text(described), shown_text(note)))
        return rows

    def _give_up(self, trial_id: int, *, superseded: bool) -> None:
        storage = self.storage
        try:
            storage.set_trial_system_attr(trial_id, _SUPERSEDED, superseded)
            storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker failed it first

    # ---- what the study holds --------------------------------------------------------------------------

    def records(self) -> list[TrialRecord]:
        """Every measured config's records, from every worker, in claim order."""
        out: list[TrialRecord] = []
        for trial in sorted(
            self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=_number
        ):
            for dumped in trial.system_attrs.get(_RECORDS, []):
                out.append(_stored_record(self.name, trial.number, dumped))
        return out

    def observed(self) -> list[tuple[dict[str, Any], float | None, bool]]:
        """Each claimed config: its knobs, its goodput when measured (None while being measured), and
        whether it is measured."""
        rows = []
        for key, trial in self.holders().items():
            if key == _VALIDATION:
                continue
            knobs = trial.system_attrs.get(_KNOBS, {})
            done = trial.state == TrialState.COMPLETE
            rows.append((dict(knobs), trial.value if done else None, done))
        return rows

    def searching(self) -> bool:
        """True while a worker still measures a config."""
        return any(
            trial.state == TrialState.RUNNING for key, trial in self.holders().items() if key != _VALIDATION
        )


def _check_same_spec(name: str, stored: Any, spec: StoredSpec) -> None:
    fingerprint = stored.get("fingerprint") if isinstance(stored, dict) else None
    if fingerprint != spec.fingerprint:
        theirs = fingerprint if isinstance(fingerprint, dict) else {}
        differing = ", ".join(shown_text(key, 40) for key in spec_differences(theirs, spec.fingerprint)[:10])
        raise ConfigError(
            f"--storage: study {name!r} holds another sweep's spec (its {differing} differ from this "
            "spec's); join it with `kvtune sweep --join` (its own spec), or give this sweep another name"
        )


def _stored_record(study: str, number: int, dumped: Any) -> TrialRecord:
    """A measured config's record as the study holds it; ConfigError when it is not one kvtune wrote: its id
    must be its knobs' (the id names folders, and another host wrote it)."""
    try:
        record = TrialRecord.model_validate(dumped)
    except ValidationError:
        record = None
    if record is None or record.config_id != config_id(record.knobs):
        raise ConfigError(
            f"--storage: study {study!r}, trial {number}, holds a record kvtune did not write (its config id "
            "is not its knobs'); the storage is shared: check who writes to it, or start another study"
        )
    return record


def dashboard_attrs(records: list[TrialRecord], goodput: float | None) -> dict[str, Any]:
    """A measured config's figures as a study shows them: goodput, SLO verdict, hit rate, preemptions and
    peak KV usage at the step that tells (goodput's, or the first missed), the config and the worker."""
    if not records:
        return {}
    trial = representative(records)
    step = telling_step(trial)
    engine = step.result.engine if step else None
    return {
        "config": describe(trial.knobs),
        "status": trial.status,
        "goodput_req_s": round(goodput, 4) if goodput is not None else 0.0,
        "met_slo": bool(goodput),
        "hit_rate": None if engine is None or engine.hit_rate is None else round(engine.hit_rate, 4),
        "preemptions": None if engine is None else engine.preemptions,
        "peak_kv_usage": None
        if engine is None or engine.peak_kv_usage is None
        else round(engine.peak_kv_usage, 4),
        "worker": trial.worker,
    }


def _number(trial: FrozenTrial) -> int:
    return trial.number


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
