"""The storage root: published artifacts, per-job work directories, the affinity and converted-model caches.

    STORAGE_ROOT/affinity/<tenant>/<fingerprint>/affinity.safetensors   one per tenant and fingerprint,
                                                                         shared by that tenant's jobs only
    STORAGE_ROOT/converted/<tenant>/<entry>/                             a GGUF model's converted copy
                                                                         (models.converted), per tenant too
    STORAGE_ROOT/jobs/<job id>/work/                                     stage outputs (resume after a crash)
    STORAGE_ROOT/jobs/<job id>/artifacts/<name>                          published files, one per artifact row

Storage keys (relative paths) are what the database records; a key is only ever built here from a
job id, a tenant, a fingerprint or an artifact name the worker chose, never from a request.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import BinaryIO

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


class Storage:
    CONVERTED = "converted"  # the root of models.converted.ConvertedCache; its namespace: tenant_scope(tenant)

    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()
        self.verified = VerifiedFiles()

    def open_verified(self, key: str, *, size: int, sha256: str) -> BinaryIO:
        """The file of `key`, checked against its recorded size and sha256 (see VerifiedFiles)."""
        return self.verified.open(self.path(key), size=size, sha256=sha256)

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
    def artifact_key(job_id: str, name: str) -> str:
        return f"jobs/{job_id}/artifacts/{name}"

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id

    def work_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "work"

    def install(self, source: Path, key: str) -> Path:
        """Move `source` to `key` (same filesystem: an atomic rename). A file already there is one no
        artifact row describes yet (an attempt that died between installing and recording): replaced.
        No hashing here: the worker calls this inside the transaction that records the row."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, dest)
        return dest
