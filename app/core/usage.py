"""What a tenant keeps in the store, its quota, and removing it: deleting a job's artifacts, and the
retention sweep that removes finished jobs' artifacts after DTP_LAYOUT_RETENTION_DAYS.

Used bytes are the declared sizes of the tenant's uploads (open ones too: what they will hold once
complete is reserved when they are declared, so parallel uploads cannot overrun the quota) plus the
artifacts of its jobs not expired. A job's row, its layouts, metrics and scores stay when its
artifacts go: `expired_at` and `expired_reason` mark it, and a download answers 410 naming when.
"""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.caller import Caller
from app.core.db import FINISHED, Artifact, Database, Job, Upload, utcnow
from app.core.errors import PayloadTooLarge, TooManyRequests
from app.core.settings import Settings
from app.core.storage import Storage

log = logging.getLogger(__name__)


def used_bytes(session: Session, tenant: str | None) -> dict[str, int]:
    """Bytes by kind: uploads_model, uploads_data (declared sizes) and artifacts (of jobs not expired)."""
    out = {"uploads_model": 0, "uploads_data": 0, "artifacts": 0}
    for kind, total in session.execute(select(Upload.kind, func.coalesce(func.sum(Upload.size), 0))
                                       .where(Upload.owner == tenant).group_by(Upload.kind)).all():
        out[f"uploads_{kind}"] = int(total)
    out["artifacts"] = int(session.scalar(
        select(func.coalesce(func.sum(Artifact.size), 0)).join(Job, Job.id == Artifact.job_id)
        .where(Job.owner == tenant, Job.expired_at.is_(None))) or 0)
    return out


def check_quota(session: Session, *, settings: Settings, tenant: str | None, asked: int, what: str) -> None:
    """413 when `asked` bytes alone exceed the tenant's quota, 429 when they do on top of what it keeps;
    both name the quota, the bytes used and asked. `asked` 0 (a job, whose output is not known before it
    runs): 429 once the tenant is at or past its quota."""
    quota = settings.quota_of(tenant)
    if quota == 0:
        return
    used = sum(used_bytes(session, tenant).values())
    words = (f"storage quota of {quota} bytes (DTP_LAYOUT_STORAGE_QUOTA_BYTES): {used} bytes used, {asked} "
             f"asked")
    if asked > quota:
        raise PayloadTooLarge(f"{what} is larger than the tenant's whole {words}", field="files")
    if used + asked > quota or (asked == 0 and used >= quota):
        raise TooManyRequests(f"{what} would exceed the tenant's {words}; delete jobs (DELETE /v1/jobs/{{id}}) "
                              "or uploads to make room", field="quota", retry_after_s=3600, code="storage_quota")


def usage(*, session: Session, settings: Settings, caller: Caller) -> dict[str, Any]:
    tenant = caller.tenant
    by_kind = used_bytes(session, tenant)
    uploads = dict(session.execute(select(Upload.status, func.count()).where(Upload.owner == tenant)
                                   .group_by(Upload.status)).all())
    jobs = int(session.scalar(select(func.count()).select_from(Job).where(Job.owner == tenant)) or 0)
    expired = int(session.scalar(select(func.count()).select_from(Job).where(Job.owner == tenant,
                                                                             Job.expired_at.is_not(None))) or 0)
    artifacts = int(session.scalar(select(func.count()).select_from(Artifact).join(Job, Job.id == Artifact.job_id)
                                   .where(Job.owner == tenant, Job.expired_at.is_(None))) or 0)
    return {"tenant": tenant, "quota_bytes": settings.quota_of(tenant), "used_bytes": sum(by_kind.values()),
            "bytes": by_kind, "counts": {"uploads_open": int(uploads.get("open", 0)),
                                         "uploads_complete": int(uploads.get("complete", 0)), "jobs": jobs,
                                         "jobs_expired": expired, "artifacts": artifacts},
            "retention_days": settings.retention_days}


# ---- removing a job's artifacts -----------------------------------------------------------------------

def remove_job_files(storage: Storage, job_id: str) -> None:
    """Every object of the job in the store (its artifacts of every attempt), and its local work directory."""
    storage.objects.delete_prefix(Storage.job_prefix(job_id))
    shutil.rmtree(storage.job_dir(job_id), ignore_errors=True)


def expire_finished(db: Database, storage: Storage, *, days: float, limit: int = 200) -> list[str]:
    """The retention sweep: finished jobs that ended more than `days` ago lose their artifacts (marked
    `retention`). Marked first, then removed: downloads answer 410 from the mark on, never a half-removed
    file."""
    if days <= 0:
        return []
    cutoff = utcnow() - timedelta(days=days)
    with db.session() as session:
        ids = list(session.scalars(select(Job.id).where(Job.status.in_(FINISHED), Job.expired_at.is_(None),
                                                        Job.finished_at < cutoff)
                                   .order_by(Job.finished_at).limit(limit)).all())
    expired = []
    for job_id in ids:
        with db.transaction() as session:
            job = session.scalars(select(Job).where(Job.id == job_id, Job.expired_at.is_(None))
                                  .with_for_update()).first()
            if job is None:
                continue
            job.expired_at, job.expired_reason, job.updated_at = utcnow(), "retention", utcnow()
        remove_job_files(storage, job_id)
        expired.append(job_id)
        log.info("job %s: artifacts removed after the retention period (%g days)", job_id, days)
    return expired
