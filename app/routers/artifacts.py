"""/v1/jobs/{job_id}/artifacts: a job's files, listed and downloaded (Range, ETag / If-None-Match, Digest).

Names are looked up in the database, never joined onto a path; the file is streamed in chunks."""

from __future__ import annotations

import base64
import mimetypes
import re
from collections.abc import Iterator
from pathlib import Path as FilePath
from pathlib import PurePosixPath
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response, StreamingResponse

from app import services
from app.deps import BaseUrl, CallerDep, DbDep, SessionDep, StorageDep, releases_session
from app.errors import NotFound, RangeNotSatisfiable, responses
from app.metrics import Metrics
from app.schemas import ArtifactList, ArtifactOut
from app.storage import CHUNK

router = APIRouter(prefix="/jobs/{job_id}/artifacts", tags=["artifacts"])

JobId = Annotated[str, Path(max_length=64, description="the job id (32 hex digits)")]
MEDIA_TYPES = ("application/octet-stream", "application/json", "text/csv", "image/png")


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


def iter_file(path: FilePath, start: int, length: int, metrics: Metrics) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        remaining = length
        while remaining > 0:
            block = f.read(min(CHUNK, remaining))
            if not block:
                break
            remaining -= len(block)
            metrics.bytes_served.inc(len(block))
            yield block


@router.get("", response_model=ArtifactList, operation_id="list_artifacts",
            summary="The job's artifacts: name, kind, size, sha256", responses=responses(404))
async def list_artifacts(job_id: JobId, db: DbDep, caller: CallerDep, base: BaseUrl) -> dict[str, Any]:
    rows = await db.run(lambda s: services.list_artifacts(session=s, job_id=job_id, caller=caller))
    url = f"{base}/v1/jobs/{job_id}/artifacts"
    return {"items": [ArtifactOut(name=a.name, kind=a.kind, size=a.size, sha256=a.sha256, link=f"{url}/{a.name}")
                      for a in rows]}


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


@router.head("/{name:path}", include_in_schema=False)
@router.get("/{name:path}", operation_id="download_artifact", response_class=StreamingResponse,
            summary="Download an artifact (Range, ETag / If-None-Match, Digest)",
            responses={200: {"content": {m: {"schema": {"type": "string", "format": "binary"}} for m in MEDIA_TYPES}},
                       206: {"description": "a byte range",
                             "content": {m: {"schema": {"type": "string", "format": "binary"}} for m in MEDIA_TYPES}},
                       304: {"description": "not modified"},
                       **responses(404, 416, _404="no such job or artifact")})
@releases_session
def download(request: Request, job_id: JobId, name: Annotated[str, Path(max_length=255, description="artifact name")],
             session: SessionDep, storage: StorageDep, caller: CallerDep) -> Response:
    art = services.get_artifact(session=session, job_id=job_id, name=name, caller=caller)
    path = storage.path(art.storage_key)
    if not path.is_file():
        raise NotFound(f"artifact {name!r} of job {job_id!r} is missing from storage", field="name")
    size, filename = path.stat().st_size, PurePosixPath(art.name).name
    headers = _headers(art, filename)
    if _not_modified(request, headers["ETag"]):
        return Response(status_code=304, headers=headers)
    media = "application/json" if filename.endswith(".json") else (
        mimetypes.guess_type(filename)[0] or "application/octet-stream")
    start, end, status = 0, size - 1, 200
    range_header, if_range = request.headers.get("range"), request.headers.get("if-range")
    if range_header and (if_range is None or if_range.strip() == headers["ETag"]):
        parsed = parse_range(range_header, size)
        if parsed == "unsatisfiable":
            raise RangeNotSatisfiable(f"range {range_header[:100]!r} is outside the artifact's {size} bytes",
                                      headers={"Content-Range": f"bytes */{size}"})
        if isinstance(parsed, tuple):
            start, end, status = parsed[0], parsed[1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
    length = max(0, end - start + 1)
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers, media_type=media)
    return StreamingResponse(iter_file(path, start, length, request.app.state.metrics), status_code=status,
                             headers=headers, media_type=media)
