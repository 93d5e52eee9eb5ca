"""Tenants' own models and data: declaring an upload, receiving its parts, completing it (each file's
sha256 verified, a model's config checked under the same limits as a hub model's), listing, deleting,
and resolving `upload:<id>` in a job spec.

An upload belongs to the tenant that declared it: another tenant naming its id gets "no such upload"
(404 from /v1/uploads, 422 in a job spec), the answer for an id that does not exist. Every name is
checked against app.core.services.upload_files before it becomes part of a storage key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from app.core.caller import Caller
from app.core.db import Database, Job, Upload, UploadFile, UploadPart, new_id, utcnow, write_transaction
from app.core.errors import Conflict, NotFound, PayloadTooLarge, SpecError, TooManyRequests
from app.core.schemas.uploads import UploadIn
from app.core.services import derived
from app.core.services.sources import SourceError
from app.core.services.upload_checks import check_contents
from app.core.services.upload_files import (
    MAX_PARTS,
    UPLOAD_ID,
    file_problem,
    layout_problem,
    part_count,
    part_length,
    ref_id,
)
from app.core.services.usage import check_quota
from app.core.settings import Settings
from app.core.storage.object_store import BadPart, ObjectMissing, Part
from app.core.storage.uploads import UploadStore

log = logging.getLogger(__name__)
ACTIVE = ("queued", "running")
# A `complete` mark older than this is a request that died (the API process was killed) and is taken
# over; a live completion takes seconds per GB (hashing), far below it.
COMPLETING_STALE_S = 3600.0


# ---- declaring -----------------------------------------------------------------------------------------

def create_upload(*, session: Session, settings: Settings, store: UploadStore, caller: Caller,
                  body: UploadIn) -> Upload:
    """Check every file's name and kind for the upload's kind, the sizes, the part count, the files per
    upload, the tenant's open uploads and the quota; record the upload, open. Raises SpecError naming
    each bad file, 413/429 past the quota, 429 past the open uploads."""
    _check_declaration(settings, body)
    total = sum(f.size for f in body.files)
    if total > settings.upload_max_bytes:
        raise PayloadTooLarge(f"the upload declares {total} bytes; this server takes at most "
                              f"{settings.upload_max_bytes} per upload (DTP_LAYOUT_UPLOAD_MAX_BYTES)", field="files")
    charged = sum(max(f.size, settings.upload_min_file_bytes) for f in body.files)
    upload_id = new_id()
    prefix = UploadStore.prefix(upload_id, tenant=caller.tenant)
    with write_transaction(session):  # fails fast, before the store is asked for anything
        _check_room(session, settings, caller.tenant, total, charged)
    multiparts = [store.begin_file(prefix, i, f.path) for i, f in enumerate(body.files)]
    try:
        with write_transaction(session):  # again, under the tenant's lock, with the rows: two at once cannot both pass
            _check_room(session, settings, caller.tenant, total, charged)
            upload = Upload(id=upload_id, owner=caller.tenant, kind=body.kind, name=body.name, status="open",
                            part_size=settings.upload_part_bytes, size=total, charged=charged, storage_prefix=prefix,
                            created_at=utcnow())
            session.add(upload)
            session.flush()
            for i, f in enumerate(body.files):
                session.add(UploadFile(upload_id=upload_id, index=i, path=f.path, size=f.size, sha256=f.sha256,
                                       multipart=multiparts[i], done=False))
    except BaseException:
        for f, multipart in zip(body.files, multiparts, strict=True):
            store.abort(prefix, f.path, multipart)
        raise
    return upload


def _check_declaration(settings: Settings, body: UploadIn) -> None:
    """422 naming each bad file: its name for the kind, declared twice, too many parts; too many files."""
    problems: list[tuple[str, str]] = []
    if len(body.files) > settings.upload_max_files:
        problems.append(("files", f"{len(body.files)} files declared; this server takes at most "
                                  f"{settings.upload_max_files} per upload (DTP_LAYOUT_UPLOAD_MAX_FILES)"))
    seen: set[str] = set()
    part_size = settings.upload_part_bytes
    for i, f in enumerate(body.files):
        if problem := file_problem(body.kind, f.path):
            problems.append((f"files.{i}.path", problem))
        elif f.path in seen:
            problems.append((f"files.{i}.path", f"{f.path!r} is declared twice"))
        seen.add(f.path)
        if part_count(f.size, part_size) > MAX_PARTS:
            problems.append((f"files.{i}.size", f"{f.size} bytes is more than {MAX_PARTS} parts of {part_size} bytes "
                                                "(DTP_LAYOUT_UPLOAD_PART_BYTES)"))
    if not problems and (problem := layout_problem(body.kind, [f.path for f in body.files])):
        problems.append(("files", problem))
    if problems:
        raise SpecError(problems)


def _check_room(session: Session, settings: Settings, tenant: str | None, total: int, charged: int) -> None:
    """The tenant's open uploads under DTP_LAYOUT_UPLOAD_MAX_OPEN and its quota with `charged` more
    (check_quota takes the tenant's lock: call inside the transaction that records the upload)."""
    what = f"an upload of {total} bytes" + (f" (counted as {charged}: each file at least "
                                            f"{settings.upload_min_file_bytes} bytes, DTP_LAYOUT_UPLOAD_MIN_FILE_BYTES)"
                                            if charged != total else "")
    check_quota(session, settings=settings, tenant=tenant, asked=charged, what=what)
    owner = Upload.owner.is_(None) if tenant is None else Upload.owner == tenant
    opened = int(session.scalar(select(func.count()).select_from(Upload).where(owner, Upload.status == "open")) or 0)
    if opened >= settings.upload_max_open:
        raise TooManyRequests(f"the tenant has {opened} open uploads, the most it may have "
                              f"(DTP_LAYOUT_UPLOAD_MAX_OPEN={settings.upload_max_open}): complete or delete one "
                              f"(open uploads are removed {settings.upload_open_ttl_s:g} s after they were "
                              "declared, DTP_LAYOUT_UPLOAD_OPEN_TTL_S)", field="files", retry_after_s=60,
                              code="too_many_open_uploads")


# ---- reading -------------------------------------------------------------------------------------------

def get_upload(*, session: Session, upload_id: str, caller: Caller, lock: bool = False) -> Upload:
    """The upload if the caller's tenant owns it (an admin: any); otherwise NotFound, whether or not it exists."""
    upload = None
    if UPLOAD_ID.fullmatch(upload_id):
        query = select(Upload).where(Upload.id == upload_id)
        if not caller.admin:
            query = query.where(Upload.owner == caller.tenant)
        upload = session.scalars(query.with_for_update() if lock else query).first()
    if upload is None:
        raise NotFound(f"no upload {upload_id[:64]!r}", field="upload_id")
    return upload


def _parts(session: Session, upload_ids: list[str]) -> dict[tuple[str, int], list[UploadPart]]:
    out: dict[tuple[str, int], list[UploadPart]] = {}
    if upload_ids:
        for part in session.scalars(select(UploadPart).where(UploadPart.upload_id.in_(upload_ids))
                                    .order_by(UploadPart.number)).all():
            out.setdefault((part.upload_id, part.file_index), []).append(part)
    return out


def upload_view(upload: Upload, parts: dict[tuple[str, int], list[UploadPart]], *, base: str = "") -> dict[str, Any]:
    files, received = [], 0
    for f in upload.files:
        have = parts.get((upload.id, f.index), [])
        got = f.size if f.done else sum(p.size for p in have)
        received += got
        files.append({"path": f.path, "size": f.size, "sha256": f.sha256, "parts": part_count(f.size, upload.part_size),
                      "parts_received": [p.number for p in have] if not f.done else
                      list(range(1, part_count(f.size, upload.part_size) + 1)), "done": f.done})
    url = f"{base}/v1/uploads/{upload.id}"
    return {"id": upload.id, "ref": f"upload:{upload.id}", "kind": upload.kind, "name": upload.name,
            "status": upload.status, "owner": upload.owner, "size": upload.size, "charged": upload.charged,
            "part_size": upload.part_size,
            "received_bytes": received, "created_at": upload.created_at.isoformat() + "Z",
            "completed_at": upload.completed_at.isoformat() + "Z" if upload.completed_at else None,
            "config": upload.config, "files": files,
            "links": {"self": url, "complete": f"{url}/complete",
                      "parts": f"{url}/files/{{path}}/parts/{{n}}"}}


def read_upload(*, session: Session, upload_id: str, caller: Caller, base: str = "") -> dict[str, Any]:
    upload = get_upload(session=session, upload_id=upload_id, caller=caller)
    return upload_view(upload, _parts(session, [upload.id]), base=base)


def list_uploads(*, session: Session, caller: Caller, base: str = "", limit: int = 50,
                 offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """A page of the caller's uploads (newest first) and how many it has in all."""
    query = select(Upload)
    if not caller.admin:
        query = query.where(Upload.owner == caller.tenant)
    total = int(session.scalar(select(func.count()).select_from(query.subquery())) or 0)
    rows = list(session.scalars(query.order_by(Upload.created_at.desc(), Upload.id).limit(limit).offset(offset)).all())
    parts = _parts(session, [u.id for u in rows])
    return [upload_view(u, parts, base=base) for u in rows], total


# ---- parts ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PartTarget:
    """Where a part goes: the upload's prefix, the file (index, name, multipart upload), its exact length."""

    prefix: str
    index: int
    name: str
    multipart: str
    length: int


def part_target(*, session: Session, upload_id: str, caller: Caller, path: str, number: int) -> PartTarget:
    """Where a part about to be sent goes; 404 for an unknown upload or file, 409 once the upload or the
    file is complete, 422 for a part number outside the file's."""
    upload = get_upload(session=session, upload_id=upload_id, caller=caller)
    if upload.status != "open":
        raise Conflict(f"upload {upload_id!r} is complete; its files can no longer change", field="upload_id")
    f = next((f for f in upload.files if f.path == path), None)
    if f is None:
        raise NotFound(f"upload {upload_id!r} declares no file {path[:200]!r} (declared: "
                       f"{', '.join(x.path for x in upload.files)[:500]})", field="path")
    if f.done:
        raise Conflict(f"file {path!r} of upload {upload_id!r} is already assembled and verified", field="path")
    parts = part_count(f.size, upload.part_size)
    if not 1 <= number <= parts:
        raise SpecError([("n", f"file {path!r} has parts 1 to {parts} ({f.size} bytes in parts of "
                               f"{upload.part_size}); got {number}")])
    return PartTarget(prefix=upload.storage_prefix, index=f.index, name=f.path, multipart=str(f.multipart),
                      length=part_length(f.size, upload.part_size, number))


def restart_file(*, session: Session, upload_id: str, index: int, multipart: str) -> None:
    """The file's multipart upload was swept: its part rows go, the new multipart upload is recorded."""
    with write_transaction(session):
        session.execute(delete(UploadPart).where(UploadPart.upload_id == upload_id, UploadPart.file_index == index))
        row = session.get(UploadFile, (upload_id, index))
        if row is not None:
            row.multipart = multipart


def record_part(*, session: Session, upload_id: str, index: int, number: int, size: int, sha256: str,
                etag: str | None) -> None:
    with write_transaction(session):
        if session.get(Upload, upload_id) is None:
            raise NotFound(f"no upload {upload_id!r} (deleted while the part was sent)", field="upload_id")
        session.execute(delete(UploadPart).where(UploadPart.upload_id == upload_id, UploadPart.file_index == index,
                                                 UploadPart.number == number))
        session.add(UploadPart(upload_id=upload_id, file_index=index, number=number, size=size, sha256=sha256,
                               etag=etag, created_at=utcnow()))


# ---- completing ----------------------------------------------------------------------------------------

def complete_upload(*, session: Session, settings: Settings, store: UploadStore, upload_id: str,
                    caller: Caller) -> Upload:
    """Assemble each file from its parts and verify its sha256 (a mismatch: the file's parts and bytes are
    dropped, 422 naming it, the rest kept to resume); then what the files hold (app.core.services.upload_checks,
    in a child process under limits). A refused model or data file: the whole upload removed, 422; a
    store that cannot be read: 503, the upload left open to complete again. One request at a time: a
    second `complete` meanwhile is 409 (`_claim_completion`)."""
    upload = _claim_completion(session, upload_id, caller)
    if upload.status == "complete":
        return upload
    uid = upload.id
    try:
        _assemble_and_check(session=session, settings=settings, store=store, upload=upload)
    finally:
        _release_completion(session, uid)
    return get_upload(session=session, upload_id=upload_id, caller=caller)


def _claim_completion(session: Session, upload_id: str, caller: Caller) -> Upload:
    """The upload, marked as being completed by this request (`completing_at`, under its row lock): a
    second `complete` meanwhile is 409, so that two never assemble the same parts (on the local store the
    loser read files the winner had moved: a 500; on S3 a misleading 422). A mark older than
    COMPLETING_STALE_S is a request that died: taken over. A complete upload is returned as it is."""
    with write_transaction(session):
        upload = get_upload(session=session, upload_id=upload_id, caller=caller, lock=True)
        if upload.status == "complete":
            return upload
        started = upload.completing_at
        if started is not None and (utcnow() - started).total_seconds() < COMPLETING_STALE_S:
            raise Conflict(f"upload {upload_id!r} is being completed by another request (since "
                           f"{started.isoformat()}Z); GET it to see when it is complete", field="upload_id",
                           code="upload_completing")
        upload.completing_at = utcnow()
    return upload


def _release_completion(session: Session, upload_id: str) -> None:
    session.rollback()
    with write_transaction(session):
        row = session.get(Upload, upload_id)
        if row is not None:
            row.completing_at = None


def _assemble_and_check(*, session: Session, settings: Settings, store: UploadStore, upload: Upload) -> None:
    """Assemble each file and verify it, then check the contents; marks the upload complete."""
    parts = _parts(session, [upload.id])
    # What the checks need, read once: the transaction ends before the (long) assembling.
    uid, prefix, kind, part_size = upload.id, upload.storage_prefix, upload.kind, upload.part_size
    files = [(f.index, f.path, f.size, f.sha256, f.multipart, f.done) for f in upload.files]
    sent = {key: [Part(number=p.number, etag=p.etag or "", size=p.size) for p in have] for key, have in parts.items()}
    received = {key: {p.number for p in have} for key, have in parts.items()}
    session.rollback()
    missing = []
    for index, path, size, _sha, _mp, done in files:
        need = set(range(1, part_count(size, part_size) + 1))
        lacking = sorted(need - received.get((uid, index), set()))
        if not done and lacking:
            shown = ", ".join(map(str, lacking[:20])) + ("…" if len(lacking) > 20 else "")
            missing.append(f"{path}: parts {shown} of {len(need)}")
    if missing:
        raise Conflict(f"upload {uid!r} is missing parts ({'; '.join(missing)[:1000]}); send them, then "
                       "complete it", field="upload_id", code="upload_incomplete")
    problems = []
    for index, path, size, sha256, multipart, done in files:
        if done:
            continue
        try:
            got, digest = store.assemble(prefix, path, multipart=str(multipart), parts=sent.get((uid, index), []))
        except (ObjectMissing, BadPart) as exc:  # swept as stale, or the store lost a part: send the file again
            restart_file(session=session, upload_id=uid, index=index, multipart=store.begin_file(prefix, index, path))
            problems.append((f"files.{index}", f"{path!r}: its parts are no longer in the store ({exc}); send them "
                                               "again"))
            continue
        if got != size or digest != sha256:
            store.drop_file(prefix, path)
            restart_file(session=session, upload_id=uid, index=index, multipart=store.begin_file(prefix, index, path))
            problems.append((f"files.{index}.sha256", f"{path!r}: the bytes received ({got} bytes, sha256 {digest}) "
                                                      f"are not the declared file ({size} bytes, sha256 {sha256}); its "
                                                      "parts were dropped: send it again"))
            continue
        with write_transaction(session):
            row = session.get(UploadFile, (uid, index))
            if row is not None:
                row.done, row.multipart = True, None
            session.execute(delete(UploadPart).where(UploadPart.upload_id == uid, UploadPart.file_index == index))
    if problems:
        raise SpecError(problems)
    try:  # in a child process under limits (app.core.services.upload_checks): no file can hang or grow this one
        config = check_contents(settings=settings, kind=kind, prefix=prefix, names=[f[1] for f in files],
                                sizes=[f[2] for f in files])
    except SpecError:
        remove_upload(session=session, store=store, upload_id=uid)
        raise
    with write_transaction(session):
        finished = session.get(Upload, uid, with_for_update=True)
        if finished is None:  # deleted meanwhile
            raise NotFound(f"no upload {uid!r} (deleted while it was being completed)", field="upload_id")
        finished.status, finished.completed_at, finished.config = "complete", utcnow(), config


# ---- deleting ------------------------------------------------------------------------------------------

def jobs_naming(session: Session, upload_id: str, owner: str | None, statuses: tuple[str, ...] = ACTIVE) -> list[str]:
    """Ids of the owner's jobs in `statuses` whose spec names `upload:<id>` (model or any data source)."""
    ref = f"upload:{upload_id}"
    rows = session.execute(select(Job.id, Job.spec).where(Job.owner == owner, Job.status.in_(statuses))).all()
    return [job_id for job_id, spec in rows if ref in spec_refs(spec)]


def spec_refs(spec: dict[str, Any]) -> set[str]:
    """The model id and every data source a stored spec names."""
    refs = {str((spec.get("model") or {}).get("id")), str((spec.get("calibration") or {}).get("source"))}
    distill = spec.get("distill") or {}
    for part in ("train", "eval"):
        refs.add(str((distill.get(part) or {}).get("source")))
    return refs


def remove_upload(*, session: Session, store: UploadStore, upload_id: str) -> None:
    row = session.get(Upload, upload_id)
    if row is None:
        session.rollback()
        return
    prefix, open_files = row.storage_prefix, [(f.path, f.multipart) for f in row.files if f.multipart]
    session.rollback()
    for name, multipart in open_files:
        store.abort(prefix, name, multipart)
    store.delete(prefix)
    with write_transaction(session):
        session.execute(delete(UploadPart).where(UploadPart.upload_id == upload_id))
        session.execute(delete(UploadFile).where(UploadFile.upload_id == upload_id))
        session.execute(delete(Upload).where(Upload.id == upload_id))
    derived.release(session, store.objects, derived.upload_needer(upload_id))  # its converted copies


def delete_upload(*, session: Session, store: UploadStore, upload_id: str, caller: Caller) -> None:
    """The upload's objects and rows; 409 while a queued or running job names it."""
    upload = get_upload(session=session, upload_id=upload_id, caller=caller)
    if naming := jobs_naming(session, upload.id, upload.owner):
        raise Conflict(f"upload {upload_id!r} is named by {len(naming)} queued or running job(s) "
                       f"({', '.join(naming[:5])}); delete it once they finish (or cancel them)", field="upload_id")
    remove_upload(session=session, store=store, upload_id=upload.id)


# ---- job specs -----------------------------------------------------------------------------------------

def resolve_ref(session: Session, ref: str, *, tenant: str | None, kind: str, field: str) -> Upload:
    """The complete upload of `kind` that `upload:<id>` names for `tenant`'s job; SourceError (a 422 at
    submit, a failed job in the worker) naming `field` otherwise. Another tenant's upload is "no upload"."""
    upload_id = ref_id(ref)
    if upload_id is None:
        raise SourceError(field, f"{ref[:100]!r}: an upload is named upload:<id> (32 hex digits: GET /v1/uploads)")
    upload = session.scalars(select(Upload).where(Upload.id == upload_id, Upload.owner == tenant)).first()
    if upload is None:
        raise SourceError(field, f"no upload {upload_id!r} (GET /v1/uploads lists this tenant's)")
    if upload.status != "complete":
        raise SourceError(field, f"upload {upload_id!r} is not complete (POST /v1/uploads/{upload_id}/complete once "
                                 "every part is in)")
    if upload.kind != kind:
        raise SourceError(field, f"upload {upload_id!r} is {upload.kind}, not {kind} ({field} names a {kind} upload)")
    return upload


def local_path(*, db: Database, store: UploadStore, ref: str, tenant: str | None, kind: str, field: str,
               cache: Path) -> Path:
    """The worker's local copy of `tenant`'s complete upload `ref`: the file of a one-file upload (a .gguf, a
    .jsonl, a .npy, one .txt), else the directory of its files. SourceError (the job fails naming
    `field`) for an upload the job's tenant does not have, not complete or of another kind."""
    with db.session() as session:
        upload = resolve_ref(session, ref, tenant=tenant, kind=kind, field=field)
        names, prefix = [f.path for f in upload.files], upload.storage_prefix
    directory = store.local_dir(prefix, names, cache=cache / upload.id)
    one_file = (len(names) == 1 and kind == "data") or names[0].endswith(".gguf")
    return directory / names[0] if one_file else directory
