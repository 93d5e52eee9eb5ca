"""The storage root: published artifacts, per-job work directories and the affinity cache.

    STORAGE_ROOT/affinity/<fingerprint>/affinity.safetensors   one per fingerprint, shared by jobs
    STORAGE_ROOT/jobs/<job id>/work/                            stage outputs (resume after a crash)
    STORAGE_ROOT/jobs/<job id>/artifacts/<name>                 published files, one per artifact row

Storage keys (relative paths) are what the database records; a key is only ever built here from a
job id, a fingerprint or an artifact name the worker chose, never from a request.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


class Storage:
    def __init__(self, root: Path) -> None:
        self.root = Path(root).absolute()

    def path(self, key: str) -> Path:
        """The file of a storage key; refuses keys that leave the root."""
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"storage key {key!r} leaves the storage root")
        return path

    @staticmethod
    def affinity_key(fingerprint: str) -> str:
        return f"affinity/{fingerprint}/affinity.safetensors"

    @staticmethod
    def artifact_key(job_id: str, name: str) -> str:
        return f"jobs/{job_id}/artifacts/{name}"

    def job_dir(self, job_id: str) -> Path:
        return self.root / "jobs" / job_id

    def work_dir(self, job_id: str) -> Path:
        return self.job_dir(job_id) / "work"

    def install(self, source: Path, key: str) -> Path:
        """Move `source` to `key` (same filesystem: an atomic rename). An existing file with the same
        content is kept (the source is dropped), so publishing twice writes the file once."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_file() and dest.stat().st_size == source.stat().st_size and sha256_file(dest) == sha256_file(source):
            source.unlink()
            return dest
        os.replace(source, dest)
        return dest
