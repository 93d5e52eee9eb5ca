"""Data derived from a tenant's uploads and jobs, owned and counted like the uploads themselves.

    converted   a GGUF model's converted copy (store: converted/<tenant scope>/<entry>/), made by the
                loading stage of a job; needed by that job and, for an uploaded GGUF, by the upload
    affinity    an affinity cache entry (store: affinity/<tenant scope>/<fingerprint>/), made or reused by
                a job's affinity stage; needed by every job that made or reused it

Each entry is a `derived_data` row (its owner, kind, store prefix and bytes: counted in the owner's
usage and quota) and one `derived_needs` row per upload or job that needs it (`upload:<id>`,
`job:<id>`). Deleting an upload, deleting a job or expiring its artifacts releases its needs; an entry
no longer needed by anything is removed from the store with its row. The workers' local copies of
what the store holds are removed by their sweep (worker.sweeps.owned) once the row is gone.
"""

from __future__ import annotations

import logging

from sqlalchemy import delete, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.db import DerivedData, DerivedNeed, utcnow, write_transaction
from app.core.storage.object_store import ObjectStore

log = logging.getLogger(__name__)
KINDS = ("converted", "affinity")


def upload_needer(upload_id: str) -> str:
    return f"upload:{upload_id}"


def job_needer(job_id: str) -> str:
    return f"job:{job_id}"


def record(session: Session, *, owner: str | None, kind: str, prefix: str, size: int, needers: list[str]) -> None:
    """The entry under `prefix` (made or found by a job) recorded for `owner` with its bytes, and needed by
    `needers`. Idempotent; two workers recording the same entry at once both succeed."""
    assert kind in KINDS and prefix.endswith("/")
    with write_transaction(session):
        row = session.scalars(select(DerivedData).where(DerivedData.prefix == prefix)).first()
        if row is None:
            try:
                with session.begin_nested():
                    row = DerivedData(owner=owner, kind=kind, prefix=prefix, size=size, created_at=utcnow())
                    session.add(row)
            except IntegrityError:  # another worker recorded it first
                row = session.scalars(select(DerivedData).where(DerivedData.prefix == prefix)).one()
        row.size = size
        have = set(session.scalars(select(DerivedNeed.needer).where(DerivedNeed.derived_id == row.id)).all())
        for needer in needers:
            if needer not in have:
                session.add(DerivedNeed(derived_id=row.id, needer=needer))


def release(session: Session, objects: ObjectStore, needer: str) -> list[str]:
    """`needer` (an upload or job going away) no longer needs anything; the entries nothing else needs
    are removed, rows first (a job starting meanwhile records its entry again), then their objects.
    Returns their prefixes."""
    session.rollback()
    with write_transaction(session):
        ids = list(session.scalars(select(DerivedNeed.derived_id).where(DerivedNeed.needer == needer)).all())
        if not ids:
            return []
        session.execute(delete(DerivedNeed).where(DerivedNeed.needer == needer))
        unneeded = list(session.scalars(
            select(DerivedData).where(DerivedData.id.in_(ids),
                                      ~exists().where(DerivedNeed.derived_id == DerivedData.id))).all())
        prefixes = [row.prefix for row in unneeded]
        if unneeded:
            session.execute(delete(DerivedData).where(DerivedData.id.in_([row.id for row in unneeded])))
    for prefix in prefixes:
        removed = objects.delete_prefix(prefix)
        log.info("derived data %s: no upload or job needs it any more; %d objects removed", prefix, removed)
    return prefixes


def prefixes_known(session: Session, kind: str) -> set[str]:
    """The store prefixes of every recorded entry of `kind` (the workers' sweep keeps their local copies)."""
    return set(session.scalars(select(DerivedData.prefix).where(DerivedData.kind == kind)).all())
