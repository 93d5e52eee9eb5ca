"""The object store's sweep, run by every worker's sweeper (worker.tasks) every STORE_SWEEP_EVERY_S:

- multipart uploads begun more than DTP_LAYOUT_MULTIPART_STALE_S ago are aborted (a worker killed while
  uploading an artifact, an API process killed while declaring an upload): S3 keeps, and bills, their
  parts until someone does. One that a declared upload's file row names is not: the owned sweep
  (worker.sweeps.owned) expires open uploads by the database's clock (DTP_LAYOUT_UPLOAD_OPEN_TTL_S).
  The store's own "initiated" time is not trusted with a live client upload: a store whose clock is
  off (moto reports every upload as begun on 2010-11-10) would have it aborted between its last part
  and its completion. Nor, in the worker's sweeper, with one not yet declared: the API begins a file's
  multipart upload a moment before it writes the row that names it, and a sweep in that moment (a worker
  starting) aborted a tenant's upload on such a store (a full suite: moto answered the next part with a
  500). The sweeper passes `seen`, when this process first listed each upload, and an undeclared upload is
  aborted only once it is stale by that clock too;
- objects under `jobs/<id>/artifacts*/` that no artifact row lists are removed once the job has ended
  or is gone (an attempt killed between its upload and its row, a run that lost its job, a retried
  attempt's copy): while the job is queued or running, its upload may be about to be recorded;
- (local store) temporaries of uploads killed half-way, older than the same age.

Several workers may sweep at once: every step is idempotent (aborting an aborted upload, deleting a
deleted object are no-ops)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import select

from app.core.db import Artifact, Database, Job, UploadFile
from app.core.jobstate import ACTIVE
from app.core.storage.object_store import ObjectStore

log = logging.getLogger("dtp_layout.worker")
STORE_SWEEP_EVERY_S = 300.0
JOBS = "jobs/"


@dataclass(frozen=True)
class StoreSweep:
    aborted: int  # multipart uploads
    removed: int  # unlisted objects of ended or deleted jobs
    temporaries: int  # local store only


def _artifact_object(key: str) -> str | None:
    """The job id of an artifact object's key (jobs/<id>/artifacts[-N]/…), else None (work directories
    of the local store live under jobs/<id>/work/ and are not objects)."""
    parts = key.split("/")
    if len(parts) >= 4 and parts[0] == "jobs" and (parts[2] == "artifacts" or parts[2].startswith("artifacts-")):
        return parts[1]
    return None


def _declared_multiparts(db: Database, upload_ids: list[str]) -> set[str]:
    """Those of `upload_ids` that an upload's file row names (a client upload the owned sweep governs)."""
    found: set[str] = set()
    for start in range(0, len(upload_ids), 500):
        chunk = upload_ids[start:start + 500]
        with db.session() as session:
            found.update(m for m in session.scalars(select(UploadFile.multipart).where(
                UploadFile.multipart.in_(chunk))) if m is not None)
    return found


def sweep_store(db: Database, objects: ObjectStore, *, stale_s: float,
                seen: dict[str, float] | None = None) -> StoreSweep:
    """`seen`: upload id → when this process first listed it, kept across sweeps by the caller (updated
    here); None trusts the store's clock alone (a one-off sweep, the tests' stale_s=0)."""
    now = time.time()
    aborted = 0
    pending = objects.list_multipart("")
    upload_ids = [u.upload_id for u in pending]
    if seen is not None:
        for gone in set(seen) - set(upload_ids):
            del seen[gone]
        for upload_id in upload_ids:
            seen.setdefault(upload_id, now)
    declared = _declared_multiparts(db, upload_ids)
    for upload in pending:
        since = upload.started if seen is None else max(upload.started, seen[upload.upload_id])
        age = now - since
        if age > stale_s and upload.upload_id not in declared:
            objects.abort_multipart(upload.key, upload.upload_id)
            log.warning("store sweep: aborted the multipart upload to %s begun %.0f s ago", upload.key, age)
            aborted += 1
    by_job: dict[str, list[str]] = {}
    for info in objects.list_prefix(JOBS):
        job_id = _artifact_object(info.key)
        if job_id is not None:
            by_job.setdefault(job_id, []).append(info.key)
    removed = 0
    for job_id, keys in by_job.items():
        with db.session() as session:
            status = session.scalars(select(Job.status).where(Job.id == job_id)).first()
            if status in ACTIVE:
                continue
            listed = set(session.scalars(select(Artifact.storage_key).where(Artifact.job_id == job_id)).all())
        unlisted = [key for key in keys if key not in listed]
        for key in unlisted:
            objects.delete(key)
        if unlisted:
            removed += len(unlisted)
            log.warning("store sweep: job %s: removed %d objects no artifact row lists", job_id, len(unlisted))
    temporaries = objects.sweep_staging(stale_s)
    return StoreSweep(aborted=aborted, removed=removed, temporaries=temporaries)
