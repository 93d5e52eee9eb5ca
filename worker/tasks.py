"""The Celery task: a thin shim that takes a job id, re-reads the job and runs it (`worker.jobs`).

Every worker also runs a sweeper thread (at start, then every lease/2 seconds, at most 30 s apart)
that re-enqueues jobs nobody holds: running jobs whose worker died or stalled (their lease expired),
so a job killed mid-stage resumes on another worker after its last finished stage, and jobs still
queued DTP_LAYOUT_REQUEUE_AFTER_S after their message was sent (the message was lost); and, every
STORE_SWEEP_EVERY_S, sweeps the object store (worker.store_sweep: stale multipart uploads, objects no
artifact row lists) and what no upload or job owns (worker.owned_sweep: expired open uploads, local
copies). With DTP_LAYOUT_RETENTION_DAYS set, it also removes the artifacts of jobs finished
longer ago than that (app.core.usage.expire_finished: the rows stay, marked expired).

Time limits: the solo pool cannot interrupt a task, so Celery's time limits would be ignored; the
job's monitor enforces them instead (`Settings.time_limits`, from the job's work tokens): past the
soft limit the run stops at its next check and the job fails with the reason; past the hard limit
(the run never reached a check) the job is marked failed and this worker process kills itself,
as Celery's hard limit kills a pool process (`dtp-layout serve`, or the service manager, restarts it).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from typing import Any

from celery.signals import worker_ready

from app.core import logs
from app.core.db import database
from app.core.queue import world_size_of
from app.core.settings import get_settings
from worker.celery_app import TASK_NAME, app, enqueue

log = logging.getLogger("dtp_layout.worker")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_job(self: Any, job_id: str) -> str:
    from worker import jobs

    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        log.error("ignoring a task with a malformed job id %r", job_id)
        return "invalid"
    settings = get_settings()
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    db = database(settings.database_url)

    def hard_limit() -> None:
        # `jobs.run_job` has already failed the job with the reason, under its lease, before calling this.
        log.error("job %s: hard time limit exceeded; killing this worker process", job_id)
        os.kill(os.getpid(), signal.SIGKILL)

    with logs.bound(job_id=job_id):  # every line logged while the job runs names it (app/core/logs.py)
        return jobs.run_job(job_id, settings=settings, db=db, worker=worker,
                            enqueue=lambda jid: send_job(db, jid), on_hard_limit=hard_limit)


def send_job(db: Any, job_id: str) -> None:
    """Enqueue a job again on its world size's queue (read from its stored spec)."""
    from sqlalchemy import select

    from app.core.db import Job

    with db.transaction() as session:
        spec = session.scalar(select(Job.spec).where(Job.id == job_id))
    enqueue(app, get_settings(), job_id, world_size=world_size_of(spec))


def sweep_once() -> list[str]:
    from worker.jobs import requeue_queued, requeue_stale

    settings = get_settings()
    db = database(settings.database_url)

    def send(jid: str) -> None:
        send_job(db, jid)

    sent = []
    for job_id in requeue_stale(db, send):
        log.warning("job %s: its worker stopped renewing the lease; re-enqueued", job_id)
        sent.append(job_id)
    for job_id in requeue_queued(db, send, after_s=settings.requeue_after_s):
        log.warning("job %s: still queued %.0f s after it was sent (message lost); re-enqueued", job_id,
                    settings.requeue_after_s)
        sent.append(job_id)
    if settings.retention_days > 0:
        from app.core.storage import Storage
        from app.core.usage import expire_finished

        expire_finished(db, Storage.from_settings(settings), days=settings.retention_days)
    return sent


def sweep_store_once() -> None:
    from app.core.storage import Storage
    from worker.owned_sweep import sweep_owned
    from worker.store_sweep import sweep_store

    settings = get_settings()
    storage = Storage.from_settings(settings)
    sweep_store(database(settings.database_url), storage.objects, stale_s=settings.multipart_stale_s)
    sweep_owned(database(settings.database_url), storage, open_ttl_s=settings.upload_open_ttl_s)


def _sweep_forever() -> None:
    from worker.store_sweep import STORE_SWEEP_EVERY_S

    settings = get_settings()
    interval = max(0.5, min(30.0, settings.lease_s / 2, settings.requeue_after_s / 2))
    store_swept = 0.0
    while True:
        try:
            sweep_once()
        except Exception:
            log.warning("sweeper: could not check for stale or lost jobs", exc_info=True)
        if time.monotonic() - store_swept >= STORE_SWEEP_EVERY_S or not store_swept:
            store_swept = time.monotonic()
            try:
                sweep_store_once()
            except Exception:
                log.warning("sweeper: could not sweep the object store", exc_info=True)
        time.sleep(interval)


@worker_ready.connect
def _start_sweeper(**_: Any) -> None:
    threading.Thread(target=_sweep_forever, name="dtp-layout-sweeper", daemon=True).start()
