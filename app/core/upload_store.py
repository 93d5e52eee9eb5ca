"""Upload bytes in the store: parts in, files assembled and verified, objects removed, and a local copy
for the worker to load.

    STORAGE/uploads/<tenant scope>/<upload id>/parts/<file index>/<n>   a part that arrived whole
    STORAGE/uploads/<tenant scope>/<upload id>/files/<name>             an assembled, verified file

A part is spooled to a temporary file while its sha256 is computed (never held in memory), then moved
into the store; a file is assembled from its parts once they are all in, hashed as it is written, and
kept only when the digest is the one the client declared.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

from app.core.storage import CHUNK, Storage, tenant_scope


class UploadStore:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    @staticmethod
    def prefix(upload_id: str, *, tenant: str | None) -> str:
        return f"uploads/{tenant_scope(tenant)}/{upload_id}"

    @staticmethod
    def file_key(prefix: str, name: str) -> str:
        return f"{prefix}/files/{name}"

    @staticmethod
    def part_key(prefix: str, index: int, number: int) -> str:
        return f"{prefix}/parts/{index}/{number}"

    def spool_dir(self) -> Path:
        path = self.storage.root / "tmp" / "upload-parts"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def put_part(self, prefix: str, index: int, number: int, spooled: Path) -> str | None:
        """Move a spooled, checked part into the store; its tag (None for a local store)."""
        self.storage.install(spooled, self.part_key(prefix, index, number))
        return None

    def begin_file(self, prefix: str, index: int, name: str) -> str | None:
        """Whatever the store needs before a file's parts arrive (an S3 multipart upload id); None here."""
        return None

    def assemble(self, prefix: str, index: int, name: str, *, parts: int, multipart: str | None,
                 etags: list[str | None] | None = None) -> tuple[int, str]:
        """The file from its parts 1…`parts`, written to its key: (size, sha256) of what was written."""
        dest = self.storage.path(self.file_key(prefix, name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.assembling")  # two completes never share it
        digest, size = hashlib.sha256(), 0
        with open(tmp, "wb") as out:
            for number in range(1, parts + 1):
                with open(self.storage.path(self.part_key(prefix, index, number)), "rb") as part:
                    while block := part.read(CHUNK):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        os.replace(tmp, dest)
        return size, digest.hexdigest()

    def drop_parts(self, prefix: str, index: int, *, multipart: str | None = None) -> None:
        shutil.rmtree(self.storage.path(f"{prefix}/parts/{index}"), ignore_errors=True)

    def drop_file(self, prefix: str, name: str) -> None:
        self.storage.path(self.file_key(prefix, name)).unlink(missing_ok=True)

    def delete(self, prefix: str) -> None:
        """Every object of the upload (parts and files)."""
        shutil.rmtree(self.storage.path(prefix), ignore_errors=True)

    def read_head(self, key: str, limit: int) -> bytes:
        """At most `limit` bytes from the start of an object (a config, a .npy header)."""
        with open(self.storage.path(key), "rb") as f:
            return f.read(limit)

    def local_dir(self, prefix: str, names: list[str], *, cache: Path | None = None) -> Path:
        """A local directory holding the upload's files, for a loader: the store's own on a local store."""
        return self.storage.path(f"{prefix}/files")
