"""/v1/uploads: a tenant's own models and data, declared, sent part by part (resumable), completed,
listed and deleted.

    POST   /v1/uploads                                  {kind, name, files: [{path, size, sha256}]} → 201, the upload
    PUT    /v1/uploads/{id}/files/{path}/parts/{n}      the part's bytes (exactly part_size, the last the rest)
    GET    /v1/uploads/{id}                             which parts are in (a client resumes with the others)
    POST   /v1/uploads/{id}/complete                    assemble, verify each file's sha256, check the model (409
                                                        while another `complete` of it runs)
    GET    /v1/uploads?limit=&offset=                   a page of the tenant's uploads (`next`: the following)
    DELETE /v1/uploads/{id}                             its objects and rows (409 while a job names it)

A part's body is streamed to a spool file while its sha256 is computed, never held in memory; a part
of the wrong length is 422 and nothing of it is kept.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path as FsPath
from typing import Annotated, Any
from urllib.parse import urlencode

import anyio
from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from app.api.check_slots import CheckSlots
from app.api.deps import BaseUrl, CallerDep, DbDep, SessionDep, SettingsDep, StorageDep, releases_session
from app.api.errors import responses
from app.core.errors import SpecError
from app.core.schemas.jobs import INT32_MAX
from app.core.schemas.uploads import UploadIn, UploadList, UploadOut
from app.core.services import uploads
from app.core.storage.root import Storage
from app.core.storage.uploads import PartsExpired, UploadStore

router = APIRouter(prefix="/uploads", tags=["uploads"])

UploadId = Annotated[str, Path(max_length=64, description="the upload id (32 hex digits)")]
FilePath = Annotated[str, Path(max_length=200, description="a declared file's name")]
PartNumber = Annotated[int, Path(ge=1, le=10_000, description="the part number, from 1")]
PART_PATH = r"^/v1/uploads/[^/]+/files/[^/]+/parts/[^/]+$"  # the route whose body limit is the part size


def store_of(storage: Storage) -> UploadStore:
    return UploadStore(storage)


@router.post("", status_code=201, response_model=UploadOut, operation_id="create_upload",
             summary="Declare an upload: its kind, name and files (path, size, sha256)", responses=responses())
@releases_session
def create(session: SessionDep, settings: SettingsDep, storage: StorageDep, caller: CallerDep, base: BaseUrl,
           body: UploadIn) -> JSONResponse:
    upload = uploads.create_upload(session=session, settings=settings, store=store_of(storage), caller=caller,
                                   body=body)
    view = uploads.read_upload(session=session, upload_id=upload.id, caller=caller, base=base)
    return JSONResponse(status_code=201, content=UploadOut.model_validate(view).model_dump(mode="json"),
                        headers={"Location": view["links"]["self"]})


@router.get("", response_model=UploadList, operation_id="list_uploads",
            summary="A page of the tenant's uploads (newest first; `next` links the following page)",
            responses=responses())
async def list_(request: Request, db: DbDep, caller: CallerDep, base: BaseUrl,
                limit: Annotated[int, Query(ge=1, le=200)] = 50,
                offset: Annotated[int, Query(ge=0, le=INT32_MAX)] = 0) -> dict[str, Any]:
    items, total = await db.run(lambda s: uploads.list_uploads(session=s, caller=caller, base=base, limit=limit,
                                                                offset=offset))
    nxt = None
    if offset + len(items) < total:
        nxt = f"{base}/v1/uploads?" + urlencode({"limit": limit, "offset": offset + limit})
    return {"items": items, "total": total, "limit": limit, "offset": offset, "next": nxt}


@router.get("/{upload_id}", response_model=UploadOut, operation_id="get_upload",
            summary="An upload: its files and which of their parts are in", responses=responses(404))
async def get(upload_id: UploadId, db: DbDep, caller: CallerDep, base: BaseUrl) -> dict[str, Any]:
    return await db.run(lambda s: uploads.read_upload(session=s, upload_id=upload_id, caller=caller, base=base))


@router.put("/{upload_id}/files/{path}/parts/{n}", status_code=204, operation_id="put_upload_part",
            summary="Send one part of a declared file (the body: exactly the part's bytes)",
            responses={**responses(404, 409, _413="the part is longer than DTP_LAYOUT_UPLOAD_PART_BYTES",
                                   _404="no such upload or file (or not the caller's)",
                                   _409="the upload or the file is already complete")},
            openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {
                "schema": {"type": "string", "format": "binary"}}}}})
async def put_part(request: Request, upload_id: UploadId, path: FilePath, n: PartNumber, db: DbDep,
                   storage: StorageDep, caller: CallerDep) -> Response:
    target = await db.run(lambda s: uploads.part_target(session=s, upload_id=upload_id, caller=caller, path=path,
                                                        number=n))
    store = store_of(storage)
    spooled, size, digest = await _spool(request, store.spool_dir(), target.length)
    try:
        if size != target.length:
            raise SpecError([("body", f"part {n} of {path!r} must be exactly {target.length} bytes; {size} arrived")])
        try:
            part = await anyio.to_thread.run_sync(store.put_part, target.prefix, target.name, target.multipart, n,
                                                  spooled)
        except PartsExpired as expired:  # the sweep aborted the file's multipart upload: start it again
            fresh = expired.multipart
            await db.run(lambda s: uploads.restart_file(session=s, upload_id=upload_id, index=target.index,
                                                        multipart=fresh))
            part = await anyio.to_thread.run_sync(store.put_part, target.prefix, target.name, fresh, n, spooled)
        await db.run(lambda s: uploads.record_part(session=s, upload_id=upload_id, index=target.index, number=n,
                                                   size=size, sha256=digest, etag=part.etag))
    finally:
        spooled.unlink(missing_ok=True)
    return Response(status_code=204, headers={"X-Part-SHA256": digest})


async def _spool(request: Request, directory: FsPath, expected: int) -> tuple[FsPath, int, str]:
    """The request body into a temporary file, hashed as it arrives; stops reading one byte past
    `expected` (the answer is then a 422: the part is longer than declared)."""
    fd, name = tempfile.mkstemp(dir=directory, suffix=".part")
    spooled, digest, size = FsPath(name), hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > expected:
                    break
                digest.update(chunk)
                await anyio.to_thread.run_sync(f.write, chunk)
    except ClientDisconnect:
        spooled.unlink(missing_ok=True)
        raise SpecError([("body", "the client left before the part's bytes arrived")]) from None
    except BaseException:
        spooled.unlink(missing_ok=True)
        raise
    return spooled, size, digest.hexdigest()


@router.post("/{upload_id}/complete", response_model=UploadOut, operation_id="complete_upload",
             summary="Assemble the files, verify each sha256, check the model's config",
             responses=responses(404, 409, 429, 503, _429="this tenant's completions being checked are at "
                                                          "DTP_LAYOUT_UPLOAD_CHECKS_PER_TENANT",
                                 _503="DTP_LAYOUT_UPLOAD_CHECKS_MAX completions are being checked, or the "
                                      "object store did not answer"))
async def complete(request: Request, upload_id: UploadId, db: DbDep, settings: SettingsDep, storage: StorageDep,
                   caller: CallerDep, base: BaseUrl) -> dict[str, Any]:
    slots: CheckSlots = request.app.state.upload_checks
    store = store_of(storage)

    def run() -> None:  # in a thread of the completions' own limiter, with its own session
        with db.database.session() as session:
            uploads.complete_upload(session=session, settings=settings, store=store, upload_id=upload_id,
                                    caller=caller)

    with slots.slot(caller.tenant, upload_id):
        await anyio.to_thread.run_sync(run, limiter=slots.limiter)
    return await db.run(lambda s: uploads.read_upload(session=s, upload_id=upload_id, caller=caller, base=base))


@router.delete("/{upload_id}", status_code=204, operation_id="delete_upload",
               summary="Delete an upload and its objects (409 while a queued or running job names it)",
               responses=responses(404, 409, _409="a queued or running job names the upload"))
@releases_session
def delete(upload_id: UploadId, session: SessionDep, storage: StorageDep, caller: CallerDep) -> Response:
    uploads.delete_upload(session=session, store=store_of(storage), upload_id=upload_id, caller=caller)
    return Response(status_code=204)
