"""A job's events: appended to the `job_events` table, read back by column.

The API records `submitted` and `cancel-requested` (with the request's id); the worker `claimed`,
`stage-start` (with the device on `loading`), `stage-done` (with its seconds), `requeued` (with the
reason), and a final `succeeded`, `failed` or `cancelled`. The job view's `device` and `timeline`, the
worker's log context, its "gave up after N attempts: REASON" and /metrics' requeue count read them.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.db import Job, JobEvent, utcnow

SUBMITTED, CLAIMED, STAGE_START, STAGE_DONE = "submitted", "claimed", "stage-start", "stage-done"
REQUEUED, CANCEL_REQUESTED = "requeued", "cancel-requested"


def record(session: Session, job_id: str, kind: str, *, stage: str | None = None, attempt: int | None = None,
           device: dict[str, Any] | None = None, request_id: str | None = None, reason: str | None = None,
           seconds: float | None = None, **detail: Any) -> JobEvent:
    """Append one event (an INSERT at the session's next flush, in the caller's transaction: an event
    is recorded exactly when what it tells is)."""
    event = JobEvent(job_id=job_id, at=utcnow(), kind=kind, stage=stage, attempt=attempt, device=device,
                     request_id=request_id, reason=reason, seconds=seconds,
                     detail={k: v for k, v in detail.items() if v is not None})
    session.add(event)
    return event


def job_events(session: Session, job_id: str) -> list[JobEvent]:
    """The job's events, oldest first."""
    return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all())


def events_by_job(session: Session, job_ids: Iterable[str]) -> dict[str, list[JobEvent]]:
    """The events of several jobs in one query (a page of the job list), oldest first, by job id."""
    ids = list(dict.fromkeys(job_ids))
    out: dict[str, list[JobEvent]] = {job_id: [] for job_id in ids}
    if ids:
        rows = session.scalars(select(JobEvent).where(JobEvent.job_id.in_(ids)).order_by(JobEvent.id)).all()
        for event in rows:
            out[event.job_id].append(event)
    return out


def submitted_request_id(session: Session, job_id: str) -> str | None:
    """The id of the request that submitted the job."""
    return session.scalar(select(JobEvent.request_id).where(JobEvent.job_id == job_id, JobEvent.kind == SUBMITTED)
                          .order_by(JobEvent.id).limit(1))


def job_log_fields(session: Session, job: Job) -> dict[str, str | None]:
    """The log context of a job's run on a worker: its tenant, and the id of the request that
    submitted it (its `submitted` event), so that the worker's lines join the API's."""
    return {"tenant": job.owner, "request_id": submitted_request_id(session, job.id)}


def last_requeue_reason(session: Session, job_id: str) -> str | None:
    """Why the job was last sent again (a stall, an expired lease, a lost message)."""
    return session.scalar(select(JobEvent.reason).where(JobEvent.job_id == job_id, JobEvent.kind == REQUEUED,
                                                        JobEvent.reason.is_not(None))
                          .order_by(JobEvent.id.desc()).limit(1))


def device(events: Iterable[JobEvent]) -> dict[str, Any] | None:
    """The device the job's latest attempt runs (or ran) on, as its worker recorded it."""
    latest = None
    for event in events:
        if isinstance(event.device, dict):
            latest = event.device
    return None if latest is None else dict(latest)


def count(session: Session, kind: str) -> int:
    """Events of `kind` over every job (e.g. the sweepers' and stalls' requeues, for /metrics)."""
    return int(session.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.kind == kind)) or 0)
