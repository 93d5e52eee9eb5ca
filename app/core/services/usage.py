"""What a tenant keeps in the store, its quota, and removing it: deleting a job's artifacts, and the
retention sweep that removes finished jobs' artifacts after DTP_LAYOUT_RETENTION_DAYS.

Used bytes are the declared sizes of the tenant's uploads (open ones too: what they will hold once
complete is reserved when they are declared, so parallel uploads cannot overrun the quota; each file at
least DTP_LAYOUT_UPLOAD_MIN_FILE_BYTES), the artifacts of its jobs not expired, what its queued and
running jobs reserved for their artifacts beyond those already published, and the data derived from its
uploads and jobs (converted models, affinity cache entries: app.core.services.derived). Every check takes the
tenant's lock in the transaction that records what it admits (`lock_tenant`). A job's row, its layouts,
metrics and scores stay when its artifacts go: `expired_at` and `expired_reason` mark it, and a download
answers 410 naming when.
"""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from app.core.caller import Caller
from app.core.db import FINISHED, Artifact, Database, DerivedData, Job, Upload, utcnow
from app.core.errors import PayloadTooLarge, TooManyRequests
from app.core.jobstate import ACTIVE
from app.core.services import derived
from app.core.settings import Settings
from app.core.storage.root import Storage

log = logging.getLogger(__name__)


def lock_tenant(session: Session, tenant: str | None) -> None:
    """Serialise the tenant's quota and capacity checks with the writes that follow them, to the end of the
    transaction: on Postgres a per-tenant advisory lock (the key budgets.check_capacity takes too: one
    transaction may take it twice); a SQLite write transaction (BEGIN IMMEDIATE) holds the database's
    only write lock already. Without it, on Postgres's READ COMMITTED, twelve parallel declarations each
    summed the same used bytes and up to four passed a quota only one fitted."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:key))"), {"key": f"dtp-layout:{tenant}"})


def _reserved_beyond_published(session: Session, tenant: str | None) -> int:
    """Of the tenant's queued and running jobs: what each reserved beyond the artifacts it has published
    (published ones are counted as artifacts; a finished job's reservation is over)."""
    published = (select(Artifact.job_id, func.sum(Artifact.size).label("size")).group_by(Artifact.job_id)
                 .subquery())
    rows = session.execute(select(Job.reserved_bytes, func.coalesce(published.c.size, 0))
                           .outerjoin(published, published.c.job_id == Job.id)
                           .where(Job.owner.is_(None) if tenant is None else Job.owner == tenant,
                                  Job.status.in_(ACTIVE))).all()
    return sum(max(0, int(reserved or 0) - int(have)) for reserved, have in rows)


def used_bytes(session: Session, tenant: str | None) -> dict[str, int]:
    """Bytes by kind: uploads_model, uploads_data (declared sizes, each file at least the minimum),
    artifacts (of jobs not expired), reserved (queued and running jobs' expected artifacts not yet
    published), and the derived data made from the tenant's uploads and jobs by kind (converted,
    affinity)."""
    out = {"uploads_model": 0, "uploads_data": 0, "artifacts": 0, "reserved": 0, "converted": 0, "affinity": 0}
    owner = Upload.owner.is_(None) if tenant is None else Upload.owner == tenant
    for kind, total in session.execute(select(Upload.kind, func.coalesce(func.sum(Upload.charged), 0))
                                       .where(owner).group_by(Upload.kind)).all():
        out[f"uploads_{kind}"] = int(total)
    out["artifacts"] = int(session.scalar(
        select(func.coalesce(func.sum(Artifact.size), 0)).join(Job, Job.id == Artifact.job_id)
        .where(Job.owner.is_(None) if tenant is None else Job.owner == tenant, Job.expired_at.is_(None))) or 0)
    out["reserved"] = _reserved_beyond_published(session, tenant)
    for kind, total in session.execute(select(DerivedData.kind, func.coalesce(func.sum(DerivedData.size), 0))
                                       .where(DerivedData.owner.is_(None) if tenant is None
                                              else DerivedData.owner == tenant)
                                       .group_by(DerivedData.kind)).all():
        out[kind] = out.get(kind, 0) + int(total)
    return out


def check_quota(session: Session, *, settings: Settings, tenant: str | None, asked: int, what: str,
                field: str = "files") -> None:
    """413 when `asked` bytes alone exceed the tenant's quota, 429 when they do on top of what it keeps; both
    name the quota, the bytes used and asked. `asked` 0: 429 once the tenant is past its quota. Takes
    the tenant's lock first (`lock_tenant`): call it inside the write transaction that records what was
    asked, so that two requests cannot both pass on the same used bytes."""
    lock_tenant(session, tenant)
    quota = settings.quota_of(tenant)
    if quota == 0:
        return
    used = sum(used_bytes(session, tenant).values())
    words = (f"storage quota of {quota} bytes (DTP_LAYOUT_STORAGE_QUOTA_BYTES): {used} bytes used, {asked} "
             f"asked")
    if asked > quota:
        raise PayloadTooLarge(f"{what} is larger than the tenant's whole {words}", field=field)
    if used + asked > quota:
        raise TooManyRequests(f"{what} would exceed the tenant's {words}; delete jobs (DELETE /v1/jobs/{{id}}) "
                              "or uploads to make room", field="quota", retry_after_s=3600, code="storage_quota")


def reserve_more(db: Database, *, settings: Settings, job_id: str, tenant: str | None, publishing: int,
                 ) -> None:
    """Before a job publishes `publishing` more bytes: its reservation raised to what it will then have
    published, if that is more, within the tenant's quota (a 429/413 ApiError past it: the job fails
    naming the quota, before the bytes reach the store)."""
    with db.transaction() as session:
        lock_tenant(session, tenant)
        job = session.get(Job, job_id)
        if job is None:
            return
        have = int(session.scalar(select(func.coalesce(func.sum(Artifact.size), 0))
                                  .where(Artifact.job_id == job_id)) or 0)
        extra = have + publishing - int(job.reserved_bytes or 0)
        if extra <= 0:
            return
        check_quota(session, settings=settings, tenant=tenant, asked=extra,
                    what=f"this job's next {publishing} bytes of artifacts ({extra} more than it reserved)",
                    field="quota")
        job.reserved_bytes = have + publishing


def usage(*, session: Session, settings: Settings, caller: Caller) -> dict[str, Any]:
    tenant = caller.tenant
    by_kind = used_bytes(session, tenant)
    mine = Job.owner.is_(None) if tenant is None else Job.owner == tenant
    uploads = dict(session.execute(select(Upload.status, func.count())
                                   .where(Upload.owner.is_(None) if tenant is None else Upload.owner == tenant)
                                   .group_by(Upload.status)).all())
    jobs = int(session.scalar(select(func.count()).select_from(Job).where(mine)) or 0)
    expired = int(session.scalar(select(func.count()).select_from(Job).where(mine, Job.expired_at.is_not(None))) or 0)
    artifacts = int(session.scalar(select(func.count()).select_from(Artifact).join(Job, Job.id == Artifact.job_id)
                                   .where(mine, Job.expired_at.is_(None))) or 0)
    kept = int(session.scalar(select(func.count()).select_from(DerivedData)
                              .where(DerivedData.owner.is_(None) if tenant is None else DerivedData.owner == tenant))
               or 0)
    return {"tenant": tenant, "quota_bytes": settings.quota_of(tenant), "used_bytes": sum(by_kind.values()),
            "bytes": by_kind, "counts": {"uploads_open": int(uploads.get("open", 0)),
                                         "uploads_complete": int(uploads.get("complete", 0)), "jobs": jobs,
                                         "jobs_expired": expired, "artifacts": artifacts, "derived": kept},
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
        with db.session() as session:
            derived.release(session, storage.objects, derived.job_needer(job_id))
        expired.append(job_id)
        log.info("job %s: artifacts removed after the retention period (%g days)", job_id, days)
    return expired
