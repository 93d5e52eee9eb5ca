"""The monitor thread of a run: it renews the job's lease, writes progress and ETA, reads the cancel
flag and watches for stalls and time limits. Torch-free, so that the Celery task starts it right
after the claim, before the slow imports of `worker.jobs` (the lease is renewed meanwhile)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import case, select

from app.core.db import Database, Job
from app.core.lease import Lease

log = logging.getLogger("dtp_layout.worker")
AUTO: Any = object()  # Monitor.report: estimate the ETA from the stage's elapsed time


class JobStalled(RuntimeError):
    """No progress for DTP_LAYOUT_STALL_S: this run is abandoned and the job retried."""


class TimeLimitExceeded(RuntimeError):
    """The run went past its soft time limit (derived from the job's size)."""


class WorkerShuttingDown(RuntimeError):
    """The worker process is shutting down (Celery's warm shutdown: SIGTERM, `dtp-layout serve` stopping):
    the run stops at its next safe point and the job goes back to the queue."""


# Set once this process begins to shut down (worker.tasks connects Celery's `worker_shutting_down`).
SHUTTING_DOWN = threading.Event()


class Monitor(threading.Thread):
    """Renews the lease, writes progress and ETA (at most once per tick) and reads the cancel flag.

    It also watches the run: no progress for `stall_s` stops the lease renewal (`stalled`; the run
    stops at its next check and the job is retried); past the soft time limit `over_time` is set;
    past the hard limit `on_hard_limit` is called (the Celery task kills its own process: a solo
    pool cannot interrupt a stage that never returns)."""

    def __init__(self, db: Database, lease: Lease, lease_s: float, *, stall_s: float = float("inf"),
                 limits: tuple[float, float] = (float("inf"), float("inf")),
                 on_hard_limit: Callable[[], None] | None = None) -> None:
        super().__init__(name=f"monitor-{lease.job_id[:8]}", daemon=True)
        self.db, self.lease, self.job_id, self.lease_s = db, lease, lease.job_id, lease_s
        self.stall_s, self.limits, self.on_hard_limit = stall_s, limits, on_hard_limit
        self.tick = max(0.05, min(1.0, lease_s / 3, stall_s / 4))
        self.cancel = threading.Event()
        self.lost = threading.Event()
        self.stalled = threading.Event()
        self.over_time = threading.Event()
        self.hard_hit = threading.Event()
        self.stage: str | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._fraction: float | None = None
        self._eta: float | None = AUTO
        self._t0 = self._stage_t0 = self._alive = self._reported_at = time.monotonic()
        self._fresh = False  # a report not yet written

    def watch_limits(self, limits: tuple[float, float], *, on_hard_limit: Callable[[], None] | None) -> None:
        """The run's (soft, hard) time limits, once its spec is read (the monitor starts at the claim,
        before it is); both count from the claim."""
        with self._lock:
            self.limits, self.on_hard_limit = limits, on_hard_limit

    def start_stage(self, stage: str | None = None) -> None:
        with self._lock:
            self._fraction, self._eta, self._stage_t0 = None, AUTO, time.monotonic()
            self._reported_at, self._fresh = self._stage_t0, False
            self._alive, self.stage = self._stage_t0, stage

    def stage_done(self) -> None:
        """The stage finished (its row says 1.0): nothing more of it is written."""
        with self._lock:
            self._fraction, self._fresh = None, False

    def beat(self) -> None:
        """The stage advanced (a micro-batch, a chunk) without a new fraction to show."""
        self._alive = time.monotonic()

    def report(self, fraction: float, eta_s: float | None = AUTO) -> None:
        """The stage's fraction done; eta_s when the caller knows better than elapsed·(1 − f)/f (a
        resumed stage starts part-way), None for not known yet."""
        now = time.monotonic()
        with self._lock:
            fraction = min(1.0, max(0.0, float(fraction)))
            if eta_s is AUTO:
                elapsed = now - self._stage_t0
                eta_s = elapsed * (1 - fraction) / fraction if fraction > 0 else None
            self._fraction, self._eta, self._reported_at, self._fresh = fraction, eta_s, now, True
            self._alive = now

    def silent_s(self) -> float:
        return time.monotonic() - self._alive

    def _progress(self) -> dict[str, Any]:
        """What the next tick writes: the latest fraction, and an ETA that counts down from the latest
        report's between reports (a stage whose reports are minutes apart does not show one frozen
        figure). Once the countdown reaches zero before the next report, the ETA is the stage's own
        pace again, elapsed·(1 − f)/f, which grows while nothing is reported. Nothing before the
        stage's first report."""
        with self._lock:
            fraction, eta, t0, at, fresh = self._fraction, self._eta, self._stage_t0, self._reported_at, self._fresh
            self._fresh = False
        if fraction is None:
            return {}
        if eta is None or eta is AUTO:
            return {"progress": fraction, "eta_s": None} if fresh else {}
        now = time.monotonic()
        left = float(eta) - (now - at)
        if left <= 0 and 0 < fraction < 1:
            left = (now - t0) * (1 - fraction) / fraction
        return {"progress": fraction, "eta_s": max(0.0, left)}

    def flush(self) -> None:
        if not self.stalled.is_set() and self.silent_s() > self.stall_s:
            log.warning("job %s: no progress in %s for %.0f s; the lease is no longer renewed",
                        self.job_id, self.stage, self.silent_s())
            self.stalled.set()
        elapsed = time.monotonic() - self._t0
        if elapsed > self.limits[0]:
            self.over_time.set()
        if elapsed > self.limits[1] and self.on_hard_limit is not None:
            self.on_hard_limit()
        with self._lock:
            stage = self.stage
        values = self._progress()
        if values:  # only onto the row of that stage: a tick racing the next stage's start leaves it at 0
            values = {name: case((Job.stage == stage, value), else_=getattr(Job, name))
                      for name, value in values.items()}
        with self.db.transaction() as session:
            if not self.stalled.is_set() and not self.lease.renew(session, self.lease_s, **values):
                self.lost.set()
            if session.scalar(select(Job.cancel_requested).where(Job.id == self.job_id)):
                self.cancel.set()

    def run(self) -> None:
        while not self._halt.wait(self.tick):
            try:
                self.flush()
            except Exception:  # a database hiccup: the lease has slack, try again next tick
                log.warning("job %s: monitor could not update the job row", self.job_id, exc_info=True)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=10)
