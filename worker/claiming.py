"""Taking a job and finding the jobs nobody holds: the claim, and the sweeps that re-send messages.

Torch-free and quick to import on purpose: the Celery task claims its job (one guarded UPDATE) before
it imports anything slow (`worker.jobs` pulls in torch), so the window in which a worker holds a
job's message without having claimed the job lasts milliseconds, not the seconds of an import. A
worker that dies in that window anyway loses the message (the embedded broker forgets a message once
delivered; Redis keeps it unacknowledged until the visibility timeout): `requeue_unclaimed`, run when
a worker (re)starts, sends every such job again at once instead of after REQUEUE_AFTER_S.

The lease and its fence (`attempts`) are app/core/lease.py's `Lease`: every write a run makes (stage
rows, layouts, artifacts, metrics, the affinity cache, the lease) checks, in the same transaction,
that the job is still at the run's attempt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select, update

from app.core import events
from app.core.db import Database, Job, db_now, utcnow
from app.core.lease import Lease

log = logging.getLogger("dtp_layout.worker")


def claim(db: Database, job_id: str, *, worker: str, lease_s: float) -> Job | None:
    """Atomically take a queued job, or a running one whose lease expired. None: nothing to do."""
    with db.transaction() as session:
        lease = Lease.claim(session, job_id, worker=worker, lease_s=lease_s)
        if lease is None:
            return None
        job = lease.fence(session)
        job.started_at = job.started_at or utcnow()
        events.record(session, job_id, events.CLAIMED, attempt=lease.attempt, worker=worker)
    return job


def job_exists(db: Database, job_id: str) -> bool:
    """Whether this database holds the job at all (a finished or deleted job's row stays): a message
    for a job it does not hold was sent by a service with another database sharing the broker."""
    with db.session() as session:
        return session.scalar(select(Job.id).where(Job.id == job_id)) is not None


def _resend(db: Database, job_id: str, send: Callable[[str], None], *, where: Any, values: dict[str, Any],
            reason: str) -> bool:
    """One sweeper's re-enqueue of one job: the guarded update is the atomic step (of several sweeping
    workers exactly one wins), then the message. A lost message is found again by the next sweeps."""
    with db.transaction() as session:
        result = session.execute(
            update(Job).where(Job.id == job_id, *where)
            .values(enqueued_at=db_now(), requeues=Job.requeues + 1, updated_at=utcnow(), **values)
            .execution_options(synchronize_session=False))
        if result.rowcount != 1:  # type: ignore[attr-defined]
            return False
        requeues = session.scalar(select(Job.requeues).where(Job.id == job_id))
        events.record(session, job_id, events.REQUEUED, reason=reason, requeues=requeues)
    try:
        send(job_id)
    except Exception:
        log.exception("could not re-enqueue job %s; a later sweep sends it again", job_id)
        return False
    return True


def requeue_stale(db: Database, send: Callable[[str], None]) -> list[str]:
    """Re-enqueue running jobs whose worker stopped renewing the lease (dead, or stalled). Clearing the
    lease makes the job claimable by whoever gets the message; should the message be lost, the job
    (queued-like: running, no lease) is swept by `requeue_queued` later."""
    with db.session() as session:
        stale = session.scalars(select(Job.id).where(Job.status == "running", Job.lease_until < db_now())).all()
    return [job_id for job_id in stale
            if _resend(db, job_id, send, where=(Job.status == "running", Job.lease_until < db_now()),
                       values={"lease_until": None}, reason="lease expired")]


def _unheld() -> tuple[Any, ...]:
    """Jobs nobody holds: queued, or running with no lease (a requeued stale job)."""
    return Job.status.in_(("queued", "running")), Job.lease_until.is_(None)


def requeue_queued(db: Database, send: Callable[[str], None], *, after_s: float) -> list[str]:
    """Re-enqueue jobs that nobody holds and whose message was sent more than `after_s` ago: the
    message was lost (crash between insert and enqueue, broker purged or restarted without persistence,
    a claim that failed on a database error). A duplicate message is harmless: `claim` lets one run
    through."""
    unheld = (*_unheld(), or_(Job.enqueued_at.is_(None), Job.enqueued_at < db_now(-after_s)))
    with db.session() as session:
        ids = session.scalars(select(Job.id).where(*unheld).order_by(Job.created_at).limit(500)).all()
    return [job_id for job_id in ids
            if _resend(db, job_id, send, where=unheld, values={},
                       reason=f"not picked up within {after_s:g} s of being queued")]


def requeue_unclaimed(db: Database, send: Callable[[str], None], *, started_at: datetime) -> list[str]:
    """At a worker's (re)start: re-send every job nobody holds whose message was sent before the start.

    A worker that died holding a message it had not yet claimed took the message with it (the embedded
    broker deletes a message once delivered; Redis returns it only after the visibility timeout), and
    the job would otherwise wait REQUEUE_AFTER_S. Messages still in the broker become duplicates, which
    `claim` makes harmless (one run goes through, the others find nothing to do). `started_at` is on
    the database clock, so workers and the database need not agree on the time."""
    unheld = (*_unheld(), or_(Job.enqueued_at.is_(None), Job.enqueued_at < started_at))
    with db.session() as session:
        ids = session.scalars(select(Job.id).where(*unheld).order_by(Job.created_at).limit(500)).all()
    return [job_id for job_id in ids
            if _resend(db, job_id, send, where=unheld, values={},
                       reason="a worker (re)started: its message may have died with a worker before the claim")]


def database_clock(db: Database) -> datetime:
    """The database's own now (what leases and `enqueued_at` are compared on)."""
    with db.session() as session:
        value = session.scalar(select(db_now()))
    assert isinstance(value, datetime)
    return value
