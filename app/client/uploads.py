"""Uploading a model directory or data files to the service (POST /v1/uploads, then the parts, then
complete), resumable: an upload of the same kind, name and files (path, size, sha256) that the tenant
left open is found with GET /v1/uploads and only the parts it lacks are sent.

    from app.client.http import LayoutClient
    from app.client.uploads import upload_path
    with LayoutClient(url, api_key=key) as client:
        done = upload_path(client, Path("my-model"))      # {"id", "ref": "upload:<id>", …}

A directory's regular, non-hidden top-level files are sent; a file alone is one file. The kind is
`model` for a directory with config.json or a .gguf file, `data` otherwise (or as given). Each part is
streamed from the file (never read whole) and retried on a dropped connection.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.client.http import ClientError, LayoutClient, _segment
from app.core.storage.root import CHUNK

PART_RETRIES = 3


class UploadMismatch(Exception):
    """The service assembled a file whose sha256 is not the one declared (the file changed while it was
    sent, or the bytes were damaged on the way): the service dropped it."""


@dataclass(frozen=True)
class LocalFile:
    path: Path
    name: str
    size: int
    sha256: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def local_files(path: Path) -> tuple[list[LocalFile], list[str]]:
    """The files an upload of `path` sends, and the names skipped (hidden files, subdirectories)."""
    if path.is_file():
        return [LocalFile(path, path.name, path.stat().st_size, _sha256(path))], []
    if not path.is_dir():
        raise ClientError(f"{path}: no such file or directory")
    files, skipped = [], []
    for entry in sorted(path.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            skipped.append(entry.name)
            continue
        files.append(LocalFile(entry, entry.name, entry.stat().st_size, _sha256(entry)))
    if not files:
        raise ClientError(f"{path}: no files to upload")
    return files, skipped


def guess_kind(path: Path, files: list[LocalFile]) -> str:
    names = {f.name for f in files}
    return "model" if "config.json" in names or any(n.endswith(".gguf") for n in names) else "data"


def _declared(files: list[LocalFile]) -> list[dict[str, Any]]:
    return [{"path": f.name, "size": f.size, "sha256": f.sha256} for f in files]


def find_open(client: LayoutClient, *, kind: str, name: str, files: list[LocalFile]) -> dict[str, Any] | None:
    """The tenant's open upload of these very files (to resume), if any."""
    want = sorted((f["path"], f["size"], f["sha256"]) for f in _declared(files))
    for upload in client.uploads():
        have = sorted((f["path"], f["size"], f["sha256"]) for f in upload["files"])
        if upload["status"] == "open" and upload["kind"] == kind and upload["name"] == name and have == want:
            return upload
    return None


def _part_body(path: Path, offset: int, length: int, on_bytes: Callable[[int], None] | None) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(offset)
        remaining = length
        while remaining > 0:
            block = f.read(min(CHUNK, remaining))
            if not block:
                raise ClientError(f"{path}: the file became shorter while it was sent")
            remaining -= len(block)
            if on_bytes is not None:
                on_bytes(len(block))
            yield block


def send_part(client: LayoutClient, upload_id: str, f: LocalFile, number: int, part_size: int,
              on_bytes: Callable[[int], None] | None = None) -> None:
    offset = (number - 1) * part_size
    length = min(part_size, f.size - offset)
    url = f"/v1/uploads/{_segment(upload_id)}/files/{_segment(f.name)}/parts/{number}"
    sent = 0

    def counted(n: int) -> None:
        nonlocal sent
        sent += n
        if on_bytes is not None:
            on_bytes(n)

    for attempt in range(PART_RETRIES + 1):
        sent = 0
        try:
            response = client.http.put(url, content=_part_body(f.path, offset, length, counted),
                                       headers={"Content-Length": str(length),
                                                "Content-Type": "application/octet-stream"})
        except httpx.HTTPError as exc:
            if on_bytes is not None and sent:
                on_bytes(-sent)
            if attempt == PART_RETRIES:
                raise client._unreachable(exc) from exc
            time.sleep(min(8.0, 0.5 * 2**attempt))
            continue
        if response.status_code in (429, 503) and attempt < PART_RETRIES:
            if on_bytes is not None and sent:
                on_bytes(-sent)
            time.sleep(min(30.0, float(response.headers.get("retry-after", "1") or 1)))
            continue
        client._raise_for(response)
        return


def upload_path(client: LayoutClient, path: Path, *, name: str | None = None, kind: str | None = None,
                on_total: Callable[[int, int], None] | None = None,
                on_bytes: Callable[[int], None] | None = None,
                on_skip: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Upload `path` (resuming the tenant's open upload of the same files); the complete upload.
    `on_total(total, already)` once the bytes to send are known, `on_bytes(n)` as they go."""
    files, skipped = local_files(path)
    for entry in skipped:
        if on_skip is not None:
            on_skip(entry)
    kind = kind or guess_kind(path, files)
    name = name or path.name
    upload = find_open(client, kind=kind, name=name, files=files)
    if upload is None:
        upload = client.create_upload({"kind": kind, "name": name, "files": _declared(files)})
    by_name = {f["path"]: f for f in upload["files"]}
    part_size = int(upload["part_size"])
    todo = []
    for f in files:
        state = by_name[f.name]
        if state["done"]:
            continue
        todo += [(f, n) for n in range(1, state["parts"] + 1) if n not in set(state["parts_received"])]
    total = sum(f.size for f in files)
    remaining = sum(min(part_size, f.size - (n - 1) * part_size) for f, n in todo)
    if on_total is not None:
        on_total(total, total - remaining)
    for f, n in todo:
        send_part(client, upload["id"], f, n, part_size, on_bytes)
    try:
        return client.complete_upload(upload["id"])
    except ClientError as exc:
        if exc.status == 422 and "sha256" in str(exc):
            raise UploadMismatch(str(exc)) from None
        raise
