"""/v1/jobs/{job_id}/artifacts: a job's files, listed and downloaded (Range, ETag / If-None-Match, Digest).

Names are looked up in the database, never joined onto a path; the object is verified against its row
(app.core.storage.root.Storage.open_verified) and streamed in chunks from the store (the local directory or
S3). With DTP_LAYOUT_STORAGE_REDIRECT and the S3 store, a verified GET answers 307 to a presigned URL of
the object instead (expiring after PRESIGN_EXPIRY_S; the client and browsers follow it, sending their
Range again)."""

from __future__ import annotations

import base64
import logging
import mimetypes
import re
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from app.api.deps import BaseUrl, CallerDep, DbDep, SessionDep, StorageDep, releases_session
from app.api.errors import responses
from app.api.metrics import Metrics
from app.core.db import Artifact
from app.core.errors import ArtifactDamaged, Gone, NotFound, RangeNotSatisfiable, StoreUnreachable
from app.core.schemas.reads import ArtifactList
from app.core.services import jobs as services
from app.core.storage.object_store import ObjectChanged
from app.core.storage.root import DamagedFile, Storage, StoreUnavailable, VerifiedObject
from models.run.files import artifact_spec

log = logging.getLogger(__name__)
router = APIRouter(prefix="/jobs/{job_id}/artifacts", tags=["artifacts"])

JobId = Annotated[str, Path(max_length=64, description="the job id (32 hex digits)")]
REDIRECT_HEADER = "X-Store-Redirect"  # `json`: a redirect answered as 200 {"location", "expires_s"} instead of 307
MEDIA_TYPES = ("application/octet-stream", "application/json", "text/csv", "image/png")


def media_type(name: str) -> str:
    """What an artifact is served as: its declared content type (models/run/files.py ARTIFACTS), else by the
    file's extension (JSON always as JSON)."""
    declared = artifact_spec(name)
    if declared is not None and declared.content_type is not None:
        return declared.content_type
    filename = PurePosixPath(name).name
    return "application/json" if filename.endswith(".json") else (
        mimetypes.guess_type(filename)[0] or "application/octet-stream")


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(start, end inclusive) of a single `bytes=` range; None to serve it all; 'unsatisfiable'."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d{0,19})\s*-\s*(\d{0,19})\s*", header)
    if not match or (not match.group(1) and not match.group(2)):
        return None  # malformed or multi-range: ignore, serve the whole file (RFC 9110 allows it)
    first, last = match.group(1), match.group(2)
    if not first:
        suffix = int(last)
        if suffix == 0:
            return "unsatisfiable"
        return max(0, size - suffix), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or (last and int(last) < start):
        return "unsatisfiable"
    return start, end


def iter_object(obj: VerifiedObject, start: int, length: int, metrics: Metrics) -> Iterator[bytes]:
    """`length` bytes of the verified object from `start`; closes it. An object replaced after it was
    verified (S3: If-Match fails) ends the body short: the client's length and sha256 checks see it."""
    try:
        for block in obj.chunks(start, length):
            metrics.bytes_served.inc(len(block))
            yield block
    except ObjectChanged:
        log.error("artifact object %s was replaced while it was served: the response is cut short", obj.key)


@router.get("", response_model=ArtifactList, operation_id="list_artifacts",
            summary="The job's artifacts: name, kind, size, sha256 (none once removed: `expired_at` says when)",
            responses=responses(404))
async def list_artifacts(job_id: JobId, db: DbDep, caller: CallerDep, base: BaseUrl) -> dict[str, Any]:
    return await db.run(lambda s: services.list_artifacts(session=s, job_id=job_id, caller=caller, base=base))


def _headers(art: Any, filename: str) -> dict[str, str]:
    b64 = base64.b64encode(bytes.fromhex(art.sha256)).decode()
    return {"ETag": f'"{art.sha256}"', "Accept-Ranges": "bytes", "Digest": f"sha-256={b64}",
            "Repr-Digest": f"sha-256=:{b64}:", "X-Checksum-SHA256": art.sha256,
            "Content-Disposition": f'attachment; filename="{filename}"', "Cache-Control": "private, max-age=0"}


def _not_modified(request: Request, etag: str) -> bool:
    inm = request.headers.get("if-none-match")
    if not inm:
        return False
    return inm.strip() == "*" or etag in [t.strip().removeprefix("W/") for t in inm.split(",")]


def _open_checked(request: Request, storage: Storage, art: Artifact, job_id: str) -> VerifiedObject:
    """The artifact's file, verified (size on every download, sha256 when the file changed since it last
    verified): a missing or damaged file is refused, logged and counted, never served as valid."""
    metrics: Metrics = request.app.state.metrics
    try:
        return storage.open_verified(art.storage_key, size=art.size, sha256=art.sha256)
    except FileNotFoundError:
        metrics.artifacts_damaged.labels("missing").inc()
        log.error("job %s: artifact %r is missing from storage", job_id, art.name)
        raise NotFound(f"artifact {art.name!r} of job {job_id!r} is missing from storage", field="name") from None
    except StoreUnavailable as exc:
        metrics.artifacts_damaged.labels("store").inc()
        log.error("job %s: artifact %r: the object store did not answer: %s", job_id, art.name, exc)
        raise StoreUnreachable(f"artifact {art.name!r} of job {job_id!r}: the object store did not answer; try "
                               "again later", headers={"Retry-After": "10"}) from None
    except (DamagedFile, OSError) as exc:
        reason = exc.reason if isinstance(exc, DamagedFile) else "unreadable"
        metrics.artifacts_damaged.labels(reason).inc()
        log.error("job %s: artifact %r is damaged on disk (%s): not served", job_id, art.name, exc)
        what = {"size": "its size no longer matches the one recorded when the job published it",
                "sha256": "its sha256 no longer matches the one recorded when the job published it"}.get(
                    reason, "the file cannot be read from the store")
        raise ArtifactDamaged(f"artifact {art.name!r} of job {job_id!r} is damaged on the server ({what}) and is not "
                              "served; the operator must restore it, or submit the job again") from None


@router.head("/{name:path}", include_in_schema=False)
@router.get("/{name:path}", operation_id="download_artifact", response_class=StreamingResponse,
            summary="Download an artifact (Range, ETag / If-None-Match, Digest)",
            responses={200: {"content": {m: {"schema": {"type": "string", "format": "binary"}} for m in MEDIA_TYPES}},
                       206: {"description": "a byte range",
                             "content": {m: {"schema": {"type": "string", "format": "binary"}} for m in MEDIA_TYPES}},
                       304: {"description": "not modified"},
                       307: {"description": "DTP_LAYOUT_STORAGE_REDIRECT: the object's presigned URL in Location "
                                            "(with `X-Store-Redirect: json`: 200 {location, expires_s} instead)"},
                       **responses(404, 410, 416, _404="no such job or artifact",
                                   _503="the database is unreachable, or the stored file is damaged (never served: "
                                        "`artifact_damaged`)")})
@releases_session
def download(request: Request, job_id: JobId, name: Annotated[str, Path(max_length=255, description="artifact name")],
             session: SessionDep, storage: StorageDep, caller: CallerDep) -> Response:
    art = services.get_artifact(session=session, job_id=job_id, name=name, caller=caller)
    if art.job.expired_at is not None:
        why = "deleted" if art.job.expired_reason == "deleted" else "past the retention period"
        raise Gone(f"artifact {art.name!r} of job {job_id!r} was removed from the store on "
                   f"{art.job.expired_at.isoformat(timespec='seconds')}Z ({why}); the job's layouts and scores stay")
    session.close()  # the row is read: end the read transaction before the (maybe long) transfer
    f = _open_checked(request, storage, art, job_id)
    size, filename = art.size, PurePosixPath(art.name).name
    headers = _headers(art, filename)
    if _not_modified(request, headers["ETag"]):
        f.close()
        return Response(status_code=304, headers=headers)
    media = media_type(art.name)
    start, end, status = 0, size - 1, 200
    range_header, if_range = request.headers.get("range"), request.headers.get("if-range")
    if range_header and (if_range is None or if_range.strip() == headers["ETag"]):
        parsed = parse_range(range_header, size)
        if parsed == "unsatisfiable":
            f.close()
            raise RangeNotSatisfiable(f"range {range_header[:100]!r} is outside the artifact's {size} bytes",
                                      headers={"Content-Range": f"bytes */{size}"})
        if isinstance(parsed, tuple):
            start, end, status = parsed[0], parsed[1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    settings = request.app.state.settings
    if settings.storage_redirect and request.method == "GET":
        url = storage.objects.presign_get(art.storage_key, expires_s=settings.presign_expiry_s, filename=filename)
        if url is not None:  # verified above; the client's Range goes to the store with it
            f.close()
            kept = {k: v for k, v in headers.items() if k in ("ETag", "Digest", "Repr-Digest", "X-Checksum-SHA256",
                                                              "Cache-Control")}
            if request.headers.get(REDIRECT_HEADER, "").lower() == "json":
                # the dashboard's fetch (it sends the key in a header, which must not follow the redirect
                # to the store, and its CSP keeps fetch on this origin): the URL, for the browser to open
                return JSONResponse({"location": url, "expires_s": settings.presign_expiry_s},
                                    headers={**kept, REDIRECT_HEADER: "json"})
            return RedirectResponse(url, status_code=307, headers=kept)
    length = max(0, end - start + 1)
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        f.close()
        return Response(status_code=status, headers=headers, media_type=media)
    return StreamingResponse(iter_object(f, start, length, request.app.state.metrics), status_code=status,
                             headers=headers, media_type=media)
