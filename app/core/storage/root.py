"""The storage root: per-job work directories (scratch, local to each worker) and, through the object store
(app.core.storage.object_store: this directory, or an S3 bucket when DTP_LAYOUT_STORAGE_URL is set), published
artifacts and the affinity and converted-model caches.

    STORAGE_ROOT/affinity/<tenant>/<fingerprint>/affinity.safetensors   one per tenant and fingerprint,
                                                                         shared by that tenant's jobs only
    STORAGE_ROOT/converted/<tenant>/<entry>/                             a GGUF model's converted copy
                                                                         (models.io.converted), per tenant too
    STORAGE_ROOT/jobs/<job id>/work/                                     stage outputs (resume after a crash)
    STORAGE_ROOT/jobs/<job id>/artifacts/<name>                          published files, one per artifact row
                                                                         (attempt 1; attempt N>1 publishes under
                                                                         jobs/<job id>/artifacts-N/: a run that
                                                                         lost its job never overwrites the
                                                                         winner's objects)

The keys (relative paths) of the object store are what the database records; a key is only ever built
here from a job id, a tenant, a fingerprint or an artifact name the worker chose, never from a request.
With the S3 store the same keys sit under the bucket's prefix, and STORAGE_ROOT holds only the work
directories and the worker's local copy of the converted-model cache.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, BinaryIO

from app.core.storage.backends import open_store
from app.core.storage.local import LocalStore
from app.core.storage.object_store import ObjectChanged, ObjectMissing, ObjectStore

if TYPE_CHECKING:
    from app.core.settings import Settings

CHUNK = 1 << 20


def tenant_scope(tenant: str | None) -> str:
    """A directory name per tenant: a digest, so that names differing only in case (one directory on a
    case-insensitive filesystem) never share it."""
    if tenant is None:
        return "open"
    return "t-" + hashlib.sha256(tenant.encode()).hexdigest()[:32]


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha256(f)


def _sha256(f: BinaryIO) -> str:
    h = hashlib.sha256()
    while block := f.read(CHUNK):
        h.update(block)
    return h.hexdigest()


class DamagedFile(Exception):
    """A stored file that no longer matches what its row recorded: `reason` is size or sha256."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class VerifiedFiles:
    """Opens stored files checked against their recorded size (every time: one fstat) and sha256
    (only when the file's identity or times changed since it last verified: hashing a checkpoint on
    every download would cost more than serving it).

    What is remembered per path: device, inode, size, mtime and ctime of the verified file, with the
    digest it matched. Rewriting a file changes its mtime and ctime (ctime cannot be set back from
    user space), and replacing it changes the inode: each forces a re-hash. The memory is per process
    and bounded (least recently used out), so each API process hashes a file once after it starts."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._verified: OrderedDict[str, tuple[tuple[int, ...], str]] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, path: Path, *, size: int, sha256: str) -> BinaryIO:
        """`path` opened for reading, positioned at 0; DamagedFile when it is not the recorded file
        (OSError when it cannot be opened). The open descriptor is what was checked: a later rename
        over the path does not change what the caller reads."""
        f = open(path, "rb")  # noqa: SIM115 (returned to the caller)
        try:
            st = os.fstat(f.fileno())
            if st.st_size != size:
                raise DamagedFile("size", f"{st.st_size} bytes on disk, {size} recorded")
            state = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            key = str(path)
            with self._lock:
                known = self._verified.get(key)
                if known is not None:
                    self._verified.move_to_end(key)
            if known != (state, sha256):
                digest = _sha256(f)
                f.seek(0)
                if digest != sha256:
                    with self._lock:
                        self._verified.pop(key, None)
                    raise DamagedFile("sha256", "the sha256 on disk differs from the recorded one")
                with self._lock:
                    self._verified[key] = (state, sha256)
                    while len(self._verified) > self.max_entries:
                        self._verified.popitem(last=False)
            return f
        except BaseException:
            f.close()
            raise


class StoreUnavailable(OSError):
    """The object store did not answer (network, credentials, a 5xx): the API says 503, never 500."""


class VerifiedObject:
    """A stored object checked against its row, read by byte ranges; a context manager (closes the file)."""

    def __init__(self, store: ObjectStore, key: str, *, file: BinaryIO | None = None, etag: str | None = None) -> None:
        self.store, self.key, self.file, self.etag = store, key, file, etag

    def chunks(self, start: int, length: int) -> Iterator[bytes]:
        """`length` bytes from `start`, in chunks of at most CHUNK (S3: pinned to the verified object by
        its ETag, ObjectChanged if it was replaced since); closes the object at the end."""
        with self:
            if self.file is not None:
                self.file.seek(start)
                remaining = length
                while remaining > 0:
                    block = self.file.read(min(CHUNK, remaining))
                    if not block:
                        break
                    remaining -= len(block)
                    yield block
                return
            yield from self.store.read(self.key, start, length, etag=self.etag)

    def read(self) -> bytes:
        """The whole object (for small ones: a summary.json); closes it."""
        with self:
            if self.file is not None:
                return self.file.read()
            return b"".join(self.store.read(self.key, etag=self.etag))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()

    def __enter__(self) -> VerifiedObject:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class VerifiedObjects:
    """VerifiedFiles for a remote store: the object's size is checked against its row on every open (one
    HEAD), its sha256 once per process and ETag (the whole object streamed through hashlib: the first
    download of an object from an API process reads it twice). A sha256 in the object's metadata is not
    trusted: it is written by the same hand as the bytes, and proves nothing about them. Reads are then
    pinned to the verified ETag (If-Match), so a replaced object is never served as the checked one."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._verified: OrderedDict[str, tuple[str, int, str]] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, store: ObjectStore, key: str, *, size: int, sha256: str) -> VerifiedObject:
        try:
            info = store.head(key)
            if info is None:
                raise ObjectMissing(key)
            if info.size != size:
                raise DamagedFile("size", f"{info.size} bytes in the store, {size} recorded")
            state = (info.etag, info.size, sha256)
            with self._lock:
                known = self._verified.get(key)
                if known is not None:
                    self._verified.move_to_end(key)
            if known != state:
                h = hashlib.sha256()
                for block in store.read(key, etag=info.etag):
                    h.update(block)
                if h.hexdigest() != sha256:
                    with self._lock:
                        self._verified.pop(key, None)
                    raise DamagedFile("sha256", "the sha256 in the store differs from the recorded one")
                with self._lock:
                    self._verified[key] = state
                    while len(self._verified) > self.max_entries:
                        self._verified.popitem(last=False)
        except ObjectChanged:
            raise DamagedFile("sha256", "the object was replaced while it was being verified") from None
        except (DamagedFile, FileNotFoundError, ValueError):
            raise
        except Exception as exc:  # botocore's errors: the store is unreachable or refused us
            raise StoreUnavailable(f"object store {store.url}: {type(exc).__name__}: {exc}") from exc
        return VerifiedObject(store, key, etag=info.etag)


class Storage:
    CONVERTED = "converted"  # the root of models.io.converted.ConvertedCache; its namespace: tenant_scope(tenant)

    def __init__(self, root: Path, objects: ObjectStore | None = None) -> None:
        self.root = Path(root).absolute()
        self.objects: ObjectStore = objects if objects is not None else LocalStore(self.root)
        self.verified = VerifiedFiles()
        self.verified_objects = VerifiedObjects()

    @classmethod
    def from_settings(cls, settings: Settings) -> Storage:
        """STORAGE_ROOT for the work directories, the store DTP_LAYOUT_STORAGE_URL names (else the root)."""
        return cls(settings.storage, open_store(settings))

    @property
    def local(self) -> bool:
        """Whether the store is this root itself (the embedded default)."""
        return isinstance(self.objects, LocalStore) and self.objects.root == self.root

    def open_verified(self, key: str, *, size: int, sha256: str) -> VerifiedObject:
        """The object of `key`, checked against its recorded size and sha256: a local file by
        VerifiedFiles, a remote object by VerifiedObjects. FileNotFoundError when absent, DamagedFile,
        StoreUnavailable (an OSError)."""
        path = self.objects.local_path(key)
        if path is not None:
            return VerifiedObject(self.objects, key, file=self.verified.open(path, size=size, sha256=sha256))
        return self.verified_objects.open(self.objects, key, size=size, sha256=sha256)

    def path(self, key: str) -> Path:
        """The file of a storage key; refuses keys that leave the root."""
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"storage key {key!r} leaves the storage root")
        return path

    @staticmethod
    def affinity_key(fingerprint: str, *, tenant: str | None) -> str:
        """The affinity cache entry of `fingerprint` for `tenant`'s jobs. Per tenant: a job that found
        another tenant's entry (`affinity_cached`, and its speed) would learn that someone ran the same
        model on the same calibration. The jobs of an open API (no keys, tenant None) share one scope."""
        return f"affinity/{tenant_scope(tenant)}/{fingerprint}/affinity.safetensors"

    @staticmethod
    def artifact_key(job_id: str, name: str, attempt: int = 1) -> str:
        """Where attempt `attempt` of a job publishes artifact `name`: per attempt, so that a run that lost
        its job (its lease expired, another worker took it) never overwrites an object the winner's row
        describes; what no row lists is swept (worker.tasks)."""
        if attempt <= 1:
            return f"jobs/{job_id}/artifacts/{name}"
        return f"jobs/{job_id}/artifacts-{attempt}/{name}"

    @staticmethod
    def job_prefix(job_id: str) -> str:
        """Every object of the job (its artifacts of every attempt)."""
        return f"jobs/{job_id}/"

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id

    def work_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "work"

    def publish(self, source: Path, key: str, *, sha256: str) -> None:
        """Put the finished local file `source` under `key` in the store: the local store hard-links it
        into place (no copy, no second hash: `sha256` is what the caller hashed), S3 uploads it (multipart
        past 64 MiB). Called before the transaction that records the row: a reader sees the row only
        once its object is whole."""
        if isinstance(self.objects, LocalStore):
            self.objects.link_in(source, key)
        else:
            self.objects.put_file(source, key, sha256=sha256)
