"""A run ends only once its stage's work has stopped (issue 41), in-process on SQLite: a stage whose work
does not poll runs in a thread under the run's stop signal; a cancel or a lost lease sets the signal,
and `run_job` returns (the worker's slot free, the job cancelled and out of its tenant's budget) only
after that thread has reached a safe point and ended. Before, the job walked away from the thread
within a tick and left it running."""

from __future__ import annotations

import threading
import time
from typing import Any

from sqlalchemy import update

from app.core.caller import OPEN
from app.core.db import Job, database
from app.core.services.jobs import cancel_job
from tests.worker.test_job_reliability import row, sqlite_settings, submit
from worker.entry import run_job
from worker.jobs import JobRun

WORK_S = 3.0  # the stage's work between two safe points: it cannot be told to stop sooner


def _stage_threads(job_id: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.endswith(job_id[:8]) and t.name != f"monitor-{job_id[:8]}"]


def _uninterruptible_calibration(monkeypatch: Any) -> threading.Event:
    """The calibration stage's work: WORK_S of work with no safe point in it (set: it finished)."""
    finished = threading.Event()
    original = JobRun.abandonable

    def work() -> None:
        time.sleep(WORK_S)
        finished.set()

    def abandonable(self: JobRun, fn: Any) -> Any:
        return original(self, work if self.stage == "calibration" else fn)

    monkeypatch.setattr(JobRun, "abandonable", abandonable)
    return finished


def _run_until_calibration(settings: Any, job_id: str, result: list[str]) -> threading.Thread:
    db = database(settings.database_url)
    runner = threading.Thread(target=lambda: result.append(run_job(job_id, settings=settings, db=db, worker="w:1")),
                              daemon=True)
    runner.start()
    deadline = time.monotonic() + 60
    while row(settings, job_id).stage != "calibration" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert row(settings, job_id).stage == "calibration"
    return runner


def test_a_cancelled_job_ends_only_once_its_stage_work_has_stopped(tmp_path, monkeypatch):
    finished = _uninterruptible_calibration(monkeypatch)
    settings = sqlite_settings(tmp_path, lease_s=3.0)
    job_id = submit(settings)
    result: list[str] = []
    runner = _run_until_calibration(settings, job_id, result)
    with database(settings.database_url).session() as session:
        cancel_job(session=session, job_id=job_id, caller=OPEN)
    time.sleep(1.5)  # a tick to see the flag, and more
    assert runner.is_alive() and not finished.is_set()
    assert row(settings, job_id).status == "running"  # still in its tenant's budget, still this worker's
    runner.join(30)
    assert finished.is_set() and result == ["cancelled"] and row(settings, job_id).status == "cancelled"
    assert _stage_threads(job_id) == []


def test_a_run_that_lost_its_lease_stops_its_stage_work_before_it_returns(tmp_path, inject_faults):
    """The stage hangs between safe points (tests/faults.py); another worker takes the job over: this run's
    stage thread stops at its next safe point and only then does the run return `lost`."""
    inject_faults(hang_stage="calibration")
    settings = sqlite_settings(tmp_path, lease_s=3.0)
    job_id = submit(settings)
    result: list[str] = []
    runner = _run_until_calibration(settings, job_id, result)
    assert _stage_threads(job_id)
    with database(settings.database_url).transaction() as session:  # the takeover: a later attempt's claim
        session.execute(update(Job).where(Job.id == job_id).values(worker="w:2", attempts=Job.attempts + 1))
    runner.join(15)
    assert result == ["lost"] and _stage_threads(job_id) == []
