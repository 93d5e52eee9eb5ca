"""Upload bytes in the object store (app.core.storage.object_store: the storage root, or S3): each declared file
is one multipart upload, begun when the upload is declared; its parts arrive in any order, from any API
process, and a part sent again replaces the earlier one; completing assembles the object.

    uploads/<tenant scope>/<upload id>/files/<name>      an assembled file (its sha256 verified)

A part is spooled to a temporary file of the API while its sha256 is computed and its length checked
(never held in memory), then streamed into the store. On completion the file's sha256 comes from the
store's own pass where it makes one (the local store hashes as it concatenates) or from reading the
object back (S3 keeps no digest of a multipart object); a file that is not the declared one is deleted.
The workers' store sweep aborts multipart uploads older than DTP_LAYOUT_MULTIPART_STALE_S: an open
upload's parts then start again (`put_part` begins a new multipart upload and says so).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from app.core.storage.object_store import ObjectMissing, ObjectStore, Part
from app.core.storage.root import Storage, tenant_scope


class PartsExpired(Exception):
    """The file's multipart upload is gone from the store (swept as stale): its parts must be sent again."""

    def __init__(self, multipart: str) -> None:
        super().__init__(multipart)
        self.multipart = multipart


class UploadStore:
    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.objects: ObjectStore = storage.objects

    @staticmethod
    def prefix(upload_id: str, *, tenant: str | None) -> str:
        return f"uploads/{tenant_scope(tenant)}/{upload_id}"

    @staticmethod
    def file_key(prefix: str, name: str) -> str:
        return f"{prefix}/files/{name}"

    def spool_dir(self) -> Path:
        path = self.storage.root / "tmp" / "upload-parts"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def begin_file(self, prefix: str, index: int, name: str) -> str:
        """The multipart upload a file's parts go to."""
        return self.objects.begin_multipart(self.file_key(prefix, name))

    def put_part(self, prefix: str, name: str, multipart: str, number: int, spooled: Path) -> Part:
        """A spooled, checked part into the file's multipart upload; PartsExpired (carrying a new multipart
        upload id) when the old one was swept."""
        key = self.file_key(prefix, name)
        size = spooled.stat().st_size
        try:
            with open(spooled, "rb") as f:
                return self.objects.put_part(key, multipart, number, f, size)
        except ObjectMissing:
            raise PartsExpired(self.objects.begin_multipart(key)) from None

    def assemble(self, prefix: str, name: str, *, multipart: str, parts: list[Part]) -> tuple[int, str]:
        """The file from its parts (ascending): (size, sha256) of the object now under its key."""
        key = self.file_key(prefix, name)
        info = self.objects.complete_multipart(key, multipart, parts)
        if info.sha256 is not None:
            return info.size, info.sha256
        digest, size = hashlib.sha256(), 0
        for block in self.objects.read(key, etag=info.etag):
            digest.update(block)
            size += len(block)
        return size, digest.hexdigest()

    def abort(self, prefix: str, name: str, multipart: str | None) -> None:
        if multipart:
            self.objects.abort_multipart(self.file_key(prefix, name), multipart)

    def drop_file(self, prefix: str, name: str) -> None:
        self.objects.delete(self.file_key(prefix, name))

    def delete(self, prefix: str) -> None:
        """Every assembled file of the upload (abort its open multipart uploads first: `abort`)."""
        self.objects.delete_prefix(prefix + "/")

    def read_head(self, key: str, limit: int) -> bytes:
        """At most `limit` bytes from the start of an object (a config, a header)."""
        info = self.objects.head(key)
        if info is None:
            raise ObjectMissing(key)
        return b"".join(self.objects.read(key, 0, min(limit, info.size), etag=info.etag)) if info.size else b""

    def local_dir(self, prefix: str, names: list[str], *, cache: Path) -> Path:
        """A local directory holding the upload's files for a loader: the store's own directory on a local
        store; else `cache`, each file fetched once (an upload never changes once complete)."""
        first = self.objects.local_path(self.file_key(prefix, names[0]))
        if first is not None:
            return first.parent
        cache.mkdir(parents=True, exist_ok=True)
        for name in names:
            dest = cache / name
            info = self.objects.head(self.file_key(prefix, name))
            if info is None:
                raise ObjectMissing(self.file_key(prefix, name))
            if not dest.is_file() or dest.stat().st_size != info.size:
                self.objects.fetch(self.file_key(prefix, name), dest)
        return cache

    def scratch_copy(self, prefix: str, name: str) -> tuple[Path, Path | None]:
        """A local file of one object for a reader that needs a path (GGUF metadata): the store's own file,
        or a temporary copy (and the directory to remove after)."""
        path = self.objects.local_path(self.file_key(prefix, name))
        if path is not None:
            return path, None
        tmp = Path(tempfile.mkdtemp(dir=self.spool_dir()))
        try:
            self.objects.fetch(self.file_key(prefix, name), tmp / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp / name, tmp
