"""The sweep's trials as Grafana annotations: a progress reporter that posts one per finished trial.

It lives with the sweep, not with the Grafana client, so the arrow runs one way: the sweep uses
observability's client, and observability knows nothing of sweeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvtune.observability.dashboards import SWEEP_ANNOTATION_TAGS
from kvtune.observability.grafana import Grafana
from kvtune.sweep.records import TrialRecord, describe

if TYPE_CHECKING:
    from kvtune.sweep.sweeper import SweepProgress
    from kvtune.sweep.trial import TrialPlan

log = logging.getLogger(__name__)


def trial_text(record: TrialRecord, run_name: str) -> str:
    """One trial as an annotation's text: which config, its knobs, and what came of it."""
    repeat = f" repeat {record.repeat}" if record.repeat > 1 else ""
    head = (
        f"kvtune sweep {run_name}: trial {record.trial}{repeat} [{record.config_id}] {describe(record.knobs)}"
    )
    if record.status == "done":
        outcome = f"goodput {record.goodput:.3g} req/s"
        if record.quality is not None and not record.quality.passed:
            outcome += " (failed the fp8 KV quality gate: cannot win)"
        return f"{head}: {outcome}"
    return f"{head}: {record.status}" + (f": {record.reason}" if record.reason else "")


class SweepAnnotations:
    """A sweep progress reporter that passes everything on to another and posts one Grafana annotation
    per finished trial, spanning the trial's start and end, tagged kvtune, sweep and the run's name.

    Annotations are a side channel: a Grafana that fails mid-sweep is warned about once and the sweep goes
    on (later failures are logged at debug level)."""

    def __init__(
        self,
        inner: SweepProgress,
        grafana: Grafana,
        run_name: str,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.inner = inner
        self.grafana = grafana
        self.run_name = run_name
        self.wall_clock = wall_clock
        self.started_ms: dict[int, int] = {}
        self.posted = 0
        self.failed = 0

    def trial_started(self, number: int, planned: int, plan: TrialPlan) -> None:
        self.started_ms[plan.number] = self._now_ms()
        self.inner.trial_started(number, planned, plan)

    def phase(self, phase: str, line: str) -> None:
        self.inner.phase(phase, line)

    def trial_finished(self, record: TrialRecord) -> None:
        self.inner.trial_finished(record)
        end = self._now_ms()
        start = self.started_ms.pop(record.trial, end - round(record.elapsed_s * 1000))
        tags = [*SWEEP_ANNOTATION_TAGS, self.run_name]  # the sweep dashboard's query
        try:
            self.grafana.annotate(trial_text(record, self.run_name), tags, start, end)
        except Exception as exc:  # noqa: BLE001 - nothing an annotation does may stop a sweep
            self.failed += 1
            if self.failed == 1:
                log.warning(
                    "trial %d's Grafana annotation was not posted (%s); the sweep goes on, and later "
                    "annotation failures are logged at debug level only", record.trial, exc,
                )  # fmt: skip
            else:
                log.debug("trial %d's Grafana annotation was not posted: %s", record.trial, exc)
        else:
            self.posted += 1

    def _now_ms(self) -> int:
        return round(self.wall_clock() * 1000)


@contextmanager
def annotating(progress: SweepProgress, grafana: Grafana | None, run_name: str) -> Iterator[SweepProgress]:
    """`progress`, annotating each finished trial in `grafana` when one is given; the client is closed
    at the end."""
    if grafana is None:
        yield progress
        return
    annotations = SweepAnnotations(progress, grafana, run_name)
    try:
        yield annotations
    finally:
        grafana.close()
        if annotations.failed:  # warned about once already; the tally says how many are missing
            log.info(
                "%d of %d trial annotations could not be posted to Grafana at %s",
                annotations.failed, annotations.failed + annotations.posted, grafana.url,
            )  # fmt: skip
