"""The converted-model cache shared through the object store (models.io.converted.EntryMirror): a GGUF
converted by one worker is pulled by the others instead of being dequantised again. Entries live under
the store's `converted/NAMESPACE/ENTRY/` keys; each worker keeps its local copy under
STORAGE_ROOT/converted/ (the directory transformers loads from)."""

from __future__ import annotations

from pathlib import Path

from app.core.storage.object_store import ObjectStore
from app.core.storage.root import Storage
from models.io.converted import MANIFEST


class StoreMirror:
    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    @staticmethod
    def prefix(name: str) -> str:
        return f"{Storage.CONVERTED}/{name}/"

    def pull(self, name: str, dest: Path) -> bool:
        prefix = self.prefix(name)
        found = {info.key[len(prefix):]: info.key for info in self.objects.list_prefix(prefix)}
        if MANIFEST not in found:  # none, or a push that died before its manifest: not an entry
            return False
        for rel, key in sorted(found.items(), key=lambda kv: kv[0] == MANIFEST):  # the manifest last
            self.objects.fetch(key, dest / rel)
        return True

    def push(self, entry: Path, name: str) -> None:
        files = sorted((p for p in entry.rglob("*") if p.is_file()), key=lambda p: (p.name == MANIFEST, str(p)))
        for path in files:
            self.objects.put_file(path, self.prefix(name) + path.relative_to(entry).as_posix())
