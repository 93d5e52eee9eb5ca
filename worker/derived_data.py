"""What a job derives from its tenant's inputs, recorded with its owner (app.core.services.derived): the
converted copy of a GGUF model its loading stage made or reused, the affinity cache entry its affinity
stage made or reused. Each is needed by the job and, for a converted upload, by the upload too; it is
counted in the tenant's usage and removed with the last of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.core.db import Database
from app.core.services import derived
from app.core.services.upload_files import ref_id
from app.core.storage.root import Storage
from models.data.source import is_upload
from models.io.converted import ConvertedCache
from models.io.loading import ModelSource


def entry_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))


def record_affinity(db: Database, storage: Storage, *, owner: str | None, fingerprint: str, job_id: str) -> None:
    """The tenant's affinity cache entry for `fingerprint` (made or reused by the job) recorded as needed by it."""
    key = Storage.affinity_key(fingerprint, tenant=owner)
    info = storage.objects.head(key)
    if info is None:  # a run that lost the job left the cache alone
        return
    with db.session() as session:
        derived.record(session, owner=owner, kind="affinity", prefix=key.rsplit("/", 1)[0] + "/", size=info.size,
                       needers=[derived.job_needer(job_id)])


def converted_needers(job_id: str, model_id: str) -> list[str]:
    """The job, and the upload it loaded the GGUF from (`upload:<id>`), if any."""
    upload_id = ref_id(model_id) if is_upload(model_id) else None
    return [derived.job_needer(job_id), *([derived.upload_needer(upload_id)] if upload_id else [])]


@dataclass(frozen=True)
class OwnedConvertedCache(ConvertedCache):
    """ConvertedCache that tells `on_entry` each entry a job loads (made here, pulled or found)."""

    on_entry: Callable[[Path], None] | None = None

    def converted_source(self, source: ModelSource, *, dtype: str = "float32") -> ModelSource:
        out = super().converted_source(source, dtype=dtype)
        if out is not source and self.on_entry is not None:
            self.on_entry(Path(out.path_or_id))
        return out


def converted_recorder(db: Database, *, owner: str | None, namespace: str, job_id: str,
                       model_id: str) -> Callable[[Path], None]:
    """What OwnedConvertedCache calls with an entry's local directory: its row, its bytes, its needers."""
    def on_entry(entry: Path) -> None:
        with db.session() as session:
            derived.record(session, owner=owner, kind="converted",
                           prefix=f"{Storage.CONVERTED}/{namespace}/{entry.name}/", size=entry_bytes(entry),
                           needers=converted_needers(job_id, model_id))
    return on_entry
