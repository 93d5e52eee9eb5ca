"""The owned-bytes sweep, run by every worker's sweeper with the store sweep (worker.tasks): what no
upload or job owns any more leaves the store and this machine's disk.

- uploads still open DTP_LAYOUT_UPLOAD_OPEN_TTL_S after they were declared are removed (their
  multipart uploads aborted, their objects and rows deleted): their quota is released;
- this machine's copies of what the store holds, once their owner is gone: a remote store's upload
  copies (STORAGE_ROOT/cache/uploads/<upload id>/), converted-model entries that no derived_data row
  lists (STORAGE_ROOT/converted/<tenant>/<entry>/, with their lock files, and the tenant's memoised file
  hashes once it has no entry left), and the work directories of jobs whose artifacts were removed
  (deleted or expired) or whose row is gone (STORAGE_ROOT/jobs/<id>/).

A local copy younger than `grace_s` is kept: a job on this machine may have made it and not yet
recorded it. Several workers may sweep at once: every step is idempotent.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from sqlalchemy import or_, select

from app.core.db import Database, Job, Upload, utcnow
from app.core.jobstate import FINISHED
from app.core.services.derived import prefixes_known
from app.core.services.uploads import remove_upload
from app.core.storage.root import Storage
from app.core.storage.uploads import UploadStore

log = logging.getLogger("dtp_layout.worker")
GRACE_S = 600.0  # a local copy younger than this may be a job's, about to be recorded
CHUNK = 1000


@dataclass(frozen=True)
class OwnedSweep:
    uploads_expired: int
    local_removed: int  # directories of this machine


def expire_open_uploads(db: Database, storage: Storage, *, ttl_s: float, limit: int = 200) -> list[str]:
    """Uploads declared more than `ttl_s` ago and still open: removed (parts aborted, objects and rows)."""
    cutoff = utcnow() - timedelta(seconds=ttl_s)
    with db.session() as session:
        # one being completed right now is left to its request (a mark older than the TTL is a dead one)
        ids = list(session.scalars(select(Upload.id).where(Upload.status == "open", Upload.created_at < cutoff,
                                                           or_(Upload.completing_at.is_(None),
                                                               Upload.completing_at < cutoff))
                                   .order_by(Upload.created_at).limit(limit)).all())
    store = UploadStore(storage)
    for upload_id in ids:
        with db.session() as session:
            remove_upload(session=session, store=store, upload_id=upload_id)
        log.info("upload %s: still open %.0f s after it was declared; removed", upload_id, ttl_s)
    return ids


def _old(path: Path, grace_s: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime >= grace_s
    except OSError:
        return False


def _remove(path: Path) -> int:
    shutil.rmtree(path, ignore_errors=True)
    return 0 if path.exists() else 1


def sweep_upload_copies(db: Database, root: Path, *, grace_s: float) -> int:
    """Copies of uploads (a remote store's, fetched for a job) whose upload is gone or not complete."""
    cache = root / "cache" / "uploads"
    if not cache.is_dir():
        return 0
    with db.session() as session:
        complete = set(session.scalars(select(Upload.id).where(Upload.status == "complete")).all())
    return sum(_remove(d) for d in cache.iterdir() if d.name not in complete and _old(d, grace_s))


def sweep_converted(db: Database, root: Path, *, grace_s: float) -> int:
    """Converted entries no derived_data row lists, their lock files, and a tenant's hash memos once it
    has no entry left (the namespace's directory then goes too)."""
    base = root / Storage.CONVERTED
    if not base.is_dir():
        return 0
    with db.session() as session:
        known = prefixes_known(session, "converted")
    removed = 0
    for namespace in [d for d in base.iterdir() if d.is_dir()]:
        for entry in [d for d in namespace.iterdir() if d.is_dir() and d.name != "sha256" and
                      not d.name.startswith(".")]:
            if f"{Storage.CONVERTED}/{namespace.name}/{entry.name}/" not in known and _old(entry, grace_s):
                removed += _remove(entry)
                (namespace / f".{entry.name}.lock").unlink(missing_ok=True)
        left = [d for d in namespace.iterdir() if d.is_dir() and d.name != "sha256"]
        if not left and _old(namespace / "sha256", grace_s):
            removed += _remove(namespace)
    return removed


def sweep_work_dirs(db: Database, root: Path, *, grace_s: float) -> int:
    """Work directories (STORAGE_ROOT/jobs/<id>/) of jobs whose artifacts were removed, or with no row."""
    jobs = root / "jobs"
    if not jobs.is_dir():
        return 0
    dirs = {d.name: d for d in jobs.iterdir() if d.is_dir()}
    names, alive = list(dirs), set()
    with db.session() as session:
        for i in range(0, len(names), CHUNK):  # below the bind-parameter limits of SQLite and Postgres
            alive |= set(session.scalars(select(Job.id).where(
                Job.id.in_(names[i:i + CHUNK]), ~(Job.status.in_(FINISHED) & Job.expired_at.is_not(None)))).all())
    return sum(_remove(d) for name, d in dirs.items() if name not in alive and _old(d, grace_s))


def sweep_owned(db: Database, storage: Storage, *, open_ttl_s: float, grace_s: float = GRACE_S) -> OwnedSweep:
    expired = expire_open_uploads(db, storage, ttl_s=open_ttl_s)
    root = storage.root
    local = sweep_upload_copies(db, root, grace_s=grace_s) + sweep_converted(db, root, grace_s=grace_s)
    local += sweep_work_dirs(db, root, grace_s=grace_s)
    if local:
        log.info("owned sweep: removed %d local directories no upload or job owns", local)
    return OwnedSweep(uploads_expired=len(expired), local_removed=local)
