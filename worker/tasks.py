"""The Celery task: a thin shim that takes a job id and hands it to the one entry point for a job
(`worker.entry.run_job`: the claim at once, before any slow import, the lease's monitor, the run). A message
for a job that this worker's database does not hold (another service's, sharing the broker) is logged as an error
and handed back to the queue a bounded number of times, then dropped with an error.

When a worker starts, it re-sends every job nobody holds whose message was sent before its start: a
worker that died between taking a message and claiming its job lost the message with it.

Every worker also runs a sweeper thread (at start, then every lease/2 seconds, at most 30 s apart)
that re-enqueues jobs nobody holds: running jobs whose worker died or stalled (their lease expired),
so a job killed mid-stage resumes on another worker after its last finished stage, and jobs still
queued DTP_LAYOUT_REQUEUE_AFTER_S after their message was sent (the message was lost); and, every
STORE_SWEEP_EVERY_S, sweeps the object store (worker.sweeps.store: stale multipart uploads, objects no
artifact row lists) and what no upload or job owns (worker.sweeps.owned: expired open uploads, local
copies). With DTP_LAYOUT_RETENTION_DAYS set, it also removes the artifacts of jobs finished
longer ago than that (app.core.services.usage.expire_finished: the rows stay, marked expired).

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

from celery.signals import task_received, worker_ready, worker_shutting_down

from app.core.broker_owner import fail_dead_lettered, note_dead_letter
from app.core.db import database
from app.core.queue import world_size_of
from app.core.settings import get_settings, redacted_url
from worker import claiming
from worker.celery_app import TASK_NAME, app, enqueue
from worker.entry import run_job
from worker.monitor import SHUTTING_DOWN

log = logging.getLogger("dtp_layout.worker")
JOB_ID = re.compile(r"^[0-9a-f]{32}$")


# How long a job's message was held before the claim: the task's receipt (Celery's `task_received`, in
# the consumer) to the claim's commit. Logged with every claim; the crash-window tests read it.
_received_at: dict[str, float] = {}
# A message for a job this worker's database does not hold goes back to the queue this many times (a
# worker of the service that sent it may take it), then is dropped with an error: never acknowledged
# silently as done, never passed around for ever.
FOREIGN_REDELIVERIES = 3
FOREIGN_RETRY_S = 1.0


@task_received.connect
def _note_receipt(request: Any = None, **_: Any) -> None:
    if request is not None and getattr(request, "id", None):
        _received_at[request.id] = time.monotonic()


@app.task(name=TASK_NAME, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def job_task(self: Any, job_id: str) -> str:
    """The queue's task (TASK_NAME): the job run through `worker.entry.run_job`."""
    received = _received_at.pop(self.request.id, None) if self.request.id else None
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        log.error("ignoring a task with a malformed job id %r", job_id)
        return "invalid"
    settings = get_settings()
    worker = f"{self.request.hostname or 'worker'}:{os.getpid()}"
    db = database(settings.database_url)

    def hard_limit() -> None:
        # `jobs.run_claimed` has already failed the job with the reason, under its lease, before calling this.
        log.error("job %s: hard time limit exceeded; killing this worker process", job_id)
        os.kill(os.getpid(), signal.SIGKILL)

    return run_job(job_id, settings=settings, db=db, worker=worker, received=received,
                   enqueue=lambda jid: send_job(db, jid), on_hard_limit=hard_limit,
                   not_claimed=lambda: _not_claimed(self, db, job_id))


def _not_claimed(task: Any, db: Any, job_id: str) -> str:
    """The claim found nothing to take: the job is finished, cancelled or leased by a live worker (a
    duplicate message; nothing to do) — or this database does not hold it at all (a message of another
    service sharing the broker): that is an error, and the message goes back for its own service's
    workers, a bounded number of times."""
    if claiming.job_exists(db, job_id):
        log.info("job %s: nothing to do (finished, cancelled or leased by a live worker)", job_id)
        return "skipped"
    where = redacted_url(get_settings().database_url)
    deliveries = int(task.request.retries or 0) + 1
    if deliveries <= FOREIGN_REDELIVERIES:
        log.error("job %s: no such job in this worker's database (%s): the message was sent by a service with "
                  "another database sharing this broker; handed back to the queue (delivery %d of %d)",
                  job_id, where, deliveries, FOREIGN_REDELIVERIES + 1)
        raise task.retry(countdown=FOREIGN_RETRY_S, max_retries=FOREIGN_REDELIVERIES)
    log.error("job %s: no such job in this worker's database (%s) after %d deliveries: message dropped "
              "(dead-lettered); check that each service has a broker of its own (docs/reliability.md)",
              job_id, where, deliveries)
    try:  # this worker cannot write the job's database: a note in the broker, for the job's own service to fail it
        note_dead_letter(get_settings(), job_id, f"dropped after {deliveries} deliveries")  # no URL: a tenant reads it
    except Exception:
        log.warning("job %s: could not leave the dead-letter note in the broker", job_id, exc_info=True)
    return "foreign"


def send_job(db: Any, job_id: str) -> None:
    """Enqueue a job again on its world size's queue (read from its stored spec)."""
    from sqlalchemy import select

    from app.core.db import Job

    with db.transaction() as session:
        spec = session.scalar(select(Job.spec).where(Job.id == job_id))
    enqueue(app, get_settings(), job_id, world_size=world_size_of(spec))


def sweep_once() -> list[str]:
    from worker.claiming import requeue_queued, requeue_stale

    settings = get_settings()
    db = database(settings.database_url)

    def send(jid: str) -> None:
        send_job(db, jid)

    for job_id in fail_dead_lettered(db, settings):
        log.error("job %s: failed: a worker of another database sharing the broker dropped its message", job_id)
    sent = []
    for job_id in requeue_stale(db, send):
        log.warning("job %s: its worker stopped renewing the lease; re-enqueued", job_id)
        sent.append(job_id)
    for job_id in requeue_queued(db, send, after_s=settings.requeue_after_s):
        log.warning("job %s: still queued %.0f s after it was sent (message lost); re-enqueued", job_id,
                    settings.requeue_after_s)
        sent.append(job_id)
    if settings.retention_days > 0:
        from app.core.services.usage import expire_finished
        from app.core.storage.root import Storage

        expire_finished(db, Storage.from_settings(settings), days=settings.retention_days)
    return sent


# multipart upload id → when this worker's sweeper first listed it (worker.sweeps.store: an undeclared upload is
# aborted only once stale by this clock too, whatever the store's own says)
MULTIPARTS_SEEN: dict[str, float] = {}


def sweep_store_once() -> None:
    from app.core.storage.root import Storage
    from worker.sweeps.owned import sweep_owned
    from worker.sweeps.store import sweep_store

    settings = get_settings()
    storage = Storage.from_settings(settings)
    sweep_store(database(settings.database_url), storage.objects, stale_s=settings.multipart_stale_s,
                seen=MULTIPARTS_SEEN)
    sweep_owned(database(settings.database_url), storage, open_ttl_s=settings.upload_open_ttl_s)


def sweep_at_start() -> list[str]:
    """Re-send the jobs nobody holds whose message was sent before this worker started (the message may
    have died with a worker before its claim: worker/claiming.py), at once rather than after REQUEUE_AFTER_S."""
    db = database(get_settings().database_url)
    started_at = claiming.database_clock(db)
    sent = claiming.requeue_unclaimed(db, lambda jid: send_job(db, jid), started_at=started_at)
    for job_id in sent:
        log.warning("job %s: queued and unclaimed when this worker started; sent again", job_id)
    return sent


def _sweep_forever() -> None:
    from worker.sweeps.store import STORE_SWEEP_EVERY_S

    settings = get_settings()
    try:
        sweep_at_start()
    except Exception:
        log.warning("sweeper: could not re-send the jobs queued before this worker started", exc_info=True)
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


@worker_shutting_down.connect
def _stop_running_work(**_: Any) -> None:
    """A warm shutdown (SIGTERM): the running job's work stops at its next safe point, its child processes
    are killed, and the job goes back to the queue (worker.failures), instead of the supervisor's SIGKILL
    ending the process mid-stage after its grace period."""
    SHUTTING_DOWN.set()


@worker_ready.connect
def _start_sweeper(**_: Any) -> None:
    threading.Thread(target=_sweep_forever, name="dtp-layout-sweeper", daemon=True).start()
