"""One entry point for a job (`run_job`): claim it at once, before anything slow (a worker that dies between
the message and the claim loses the message, and the job would wait for a sweep: worker/claiming.py); renew
its lease from then on (`worker.monitor.Monitor`); import the run's code under that lease (torch: seconds on
a loaded machine, longer than a short lease); and run it (`worker.jobs.run_claimed`). The Celery task
(worker/tasks.py) comes through here, and so do in-process callers (the tests).

Light on purpose: importing this module imports neither torch nor the run's code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from app.core import logs
from app.core.db import Database
from app.core.lease import Lease
from app.core.settings import Settings
from worker import claiming
from worker.monitor import Monitor

log = logging.getLogger("dtp_layout.worker")


def run_job(job_id: str, *, settings: Settings, db: Database, worker: str,
            enqueue: Callable[[str], None] | None = None, on_hard_limit: Callable[[], None] | None = None,
            not_claimed: Callable[[], str] | None = None, received: float | None = None) -> str:
    """Claim and run the job; returns what happened: skipped, succeeded, failed, cancelled, retried
    (the run stalled; the job is queued again) or lost (another run holds the job now).

    `not_claimed`: what a claim that found nothing comes to (default: "skipped", the job being finished,
    cancelled or leased by a live worker; the Celery task also tells a job of another service's database).
    `received`: when the job's message was received (time.monotonic()), for the claim's log line.
    `on_hard_limit`: called once the job has been failed past its hard time limit (the task kills its
    process); `enqueue`: sends a message for a job again (a stalled run's retry)."""
    with logs.bound(job_id=job_id):  # every line logged while the job runs names it (app/core/logs.py)
        job = claiming.claim(db, job_id, worker=worker, lease_s=settings.lease_s)
        if job is None:
            if not_claimed is not None:
                return not_claimed()
            log.info("job %s: nothing to do (finished, cancelled or leased by a live worker)", job_id)
            return "skipped"
        held_s = time.monotonic() - received if received is not None else float("nan")
        log.info("job %s: claimed (attempt %d) %.3f s after its message was received", job_id, job.attempts, held_s)
        # The lease is renewed from now on; importing the run's code (torch) happens under it.
        monitor = Monitor(db, Lease(job_id, worker, job.attempts), settings.lease_s, stall_s=settings.stall_s)
        monitor.start()
        try:
            from worker import jobs
        except BaseException:
            monitor.stop()
            raise
        return jobs.run_claimed(job, settings=settings, db=db, worker=worker, monitor=monitor, enqueue=enqueue,
                                on_hard_limit=on_hard_limit)
