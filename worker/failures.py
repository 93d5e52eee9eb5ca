"""How a run ends when it does not succeed: the job failed or cancelled under its lease (`_end`), a stalled
run sent again or given up (`_retry`), the error text its tenant reads (`public_error`), and what each
exception a run raises comes to (`ended_by`: lost, retried, cancelled or failed)."""

from __future__ import annotations

import logging
import re
import traceback
from collections.abc import Callable

from app.core import events
from app.core.db import Database, db_now, utcnow
from app.core.lease import Lease, LeaseLost
from app.core.safe_text import for_log
from app.core.settings import Settings
from app.core.storage.root import Storage, tenant_scope
from worker.device import out_of_memory_message
from worker.monitor import JobStalled, TimeLimitExceeded, WorkerShuttingDown
from worker.outages import database_unreachable, disk_full, no_space_message, remove_work
from worker.run import JobCancelled

log = logging.getLogger("dtp_layout.worker")


def _end(db: Database, lease: Lease, *, status: str, error: str | None, stage: str | None) -> bool:
    """Mark the job failed or cancelled, if this lease still holds it. The error is stored as data: any
    non-printable character it holds (a tenant's file's text, issue 41) written as an escape."""
    error = for_log(error) if error is not None else None
    with db.transaction() as session:
        job = lease.held(session)
        if job is None:
            return False
        now = utcnow()
        stage = stage or job.stage
        job.status, job.error, job.error_stage = status, error, stage if status == "failed" else None
        job.stage = stage
        job.finished_at, job.updated_at, job.lease_until, job.eta_s = now, now, None, None
        events.record(session, lease.job_id, status, stage=stage, attempt=job.attempts, error=error)
    return True


def _retry(db: Database, lease: Lease, *, reason: str, stage: str | None, max_attempts: int,
           enqueue: Callable[[str], None] | None) -> str:
    """This run was abandoned (it stalled): back to `queued` and sent again, or `failed` once the job
    has had `max_attempts` runs. A lost message is found by the queued sweeper."""
    if lease.attempt >= max_attempts:
        _end(db, lease, status="failed", stage=stage, error=f"gave up after {lease.attempt} attempts: {reason}")
        return "failed"
    with db.transaction() as session:
        job = lease.held(session)
        if job is None:
            return "lost"
        job.status, job.worker, job.lease_until, job.eta_s = "queued", None, None, None
        job.enqueued_at, job.requeues, job.updated_at = db_now(), (job.requeues or 0) + 1, utcnow()
        events.record(session, lease.job_id, events.REQUEUED, reason=reason, stage=stage, attempt=lease.attempt,
                      requeues=job.requeues)
    if enqueue is not None:
        try:
            enqueue(lease.job_id)
        except Exception:
            log.exception("job %s: could not re-enqueue it; the queued sweeper will", lease.job_id)
    return "retried"


MAX_ERROR_CHARS = 2000
_JOB_DIR = re.compile(r"jobs/([0-9a-f]{32})")
_CACHE_DIR = re.compile(r"(affinity|converted)/([^/\s'\"]+)/")  # the per-tenant caches


def public_error(message: str, *, job_id: str, tenant: str | None) -> str:
    """The error text stored on the job (what its tenant reads): bounded, and without the names of other
    jobs' directories or other tenants' cache entries, should a message ever carry one. The whole text
    goes to the worker's log when anything was cut."""
    shown = _JOB_DIR.sub(lambda m: m.group(0) if m.group(1) == job_id else "jobs/…", message)
    own = tenant_scope(tenant)
    shown = _CACHE_DIR.sub(lambda m: m.group(0) if m.group(2) == own else f"{m.group(1)}/…/", shown)
    if len(shown) > MAX_ERROR_CHARS:
        shown = shown[:MAX_ERROR_CHARS] + " … (cut: the rest is in the worker's log)"
    if shown != message:
        log.warning("job %s: the error, as stored for its tenant, was cut or masked; in full: %s", job_id, message)
    return shown


def user_errors() -> tuple[type[BaseException], ...]:
    from models.export.files import ExportError
    from models.io.assets import AssetNotFoundError

    return (ValueError, AssetNotFoundError, ExportError, OSError)


def ended_by(exc: Exception, *, db: Database, lease: Lease, settings: Settings, job_id: str, owner: str | None,
             stage: str | None, enqueue: Callable[[str], None] | None) -> str:
    """What a run that raised `exc` comes to (`run_claimed`'s answer), recorded under its lease: lost (another
    run holds the job), retried (it stalled; or the database is unreachable), cancelled or failed. Called
    while `exc` is being handled (a failure's log line carries its traceback)."""
    if isinstance(exc, LeaseLost):
        log.warning("job %s: lease lost; leaving it to the worker that holds it", job_id)
        return "lost"
    if isinstance(exc, JobStalled | WorkerShuttingDown):
        log.warning("job %s: %s", job_id, exc)
        return _retry(db, lease, reason=str(exc), stage=stage, max_attempts=settings.max_attempts,
                      enqueue=enqueue)
    from models.affinity.scoring import Cancelled

    if isinstance(exc, JobCancelled | Cancelled):
        _end(db, lease, status="cancelled", error="cancelled by request", stage=stage)
        return "cancelled"
    if database_unreachable(exc):  # nothing can be recorded: the lease expires, a sweeper retries it
        log.warning("job %s: the database became unreachable during %s; left to be retried when it is back",
                    job_id, stage)
        return "retried"
    if disk_full(exc, settings.storage):
        log.error("job %s: the storage volume is full (%s): %s", job_id, stage, exc)
        if _end(db, lease, status="failed", error=no_space_message(stage, settings.storage), stage=stage):
            remove_work(Storage(settings.storage).work_dir(job_id))  # once ended by us: no attempt resumes
        return "failed"
    oom = out_of_memory_message(exc, stage=stage)
    if oom is not None:
        message = oom
        log.error("job %s: %s", job_id, oom)
    elif isinstance(exc, (*user_errors(), TimeLimitExceeded)):
        message = str(exc)
    else:
        message = f"{type(exc).__name__}: {exc}"
        log.error("job %s failed in %s:\n%s", job_id, stage, traceback.format_exc())
    _end(db, lease, status="failed", error=public_error(message, job_id=job_id, tenant=owner), stage=stage)
    return "failed"
