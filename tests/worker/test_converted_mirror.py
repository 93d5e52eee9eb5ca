"""Converted GGUF copies shared through the object store (worker.converted_mirror on a real S3 API server,
moto's ThreadedMotoServer): a worker converts once and pushes; another worker, on an empty disk of its
own, pulls the entry instead of converting; an entry whose push died before its manifest is never pulled."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.io.converted import MANIFEST, ConvertedCache
from models.io.loading import ModelSource
from tests.tiny import tiny_gguf
from worker.converted_mirror import StoreMirror


def files(entry: Path) -> dict[str, bytes]:
    return {str(p.relative_to(entry)): p.read_bytes() for p in sorted(entry.rglob("*")) if p.is_file()}


def test_a_second_machine_pulls_the_converted_copy_instead_of_converting(tmp_path, s3_server, s3_bucket,
                                                                         monkeypatch):
    store = s3_server.store(s3_bucket)
    gguf = tmp_path / "models" / "tiny.gguf"
    gguf.parent.mkdir()
    tiny_gguf(gguf)
    source = ModelSource(str(gguf))
    first = ConvertedCache(tmp_path / "machine-1", namespace="t-a", mirror=StoreMirror(store))
    made = Path(first.converted_source(source).path_or_id)
    keys = {i.key for i in store.list_prefix("converted/")}
    assert {f"converted/t-a/{made.name}/{rel}" for rel in files(made)} == keys

    def no_conversion(*_: object) -> None:
        raise AssertionError("converted again on the second machine")

    monkeypatch.setattr(ConvertedCache, "_write", staticmethod(no_conversion))
    second = ConvertedCache(tmp_path / "machine-2", namespace="t-a", mirror=StoreMirror(store))
    assert second.lookup(source, dtype="float32") is not None
    pulled = Path(second.converted_source(source).path_or_id)
    assert pulled.is_relative_to(tmp_path / "machine-2") and files(pulled) == files(made)

    other_tenant = ConvertedCache(tmp_path / "machine-3", namespace="t-b", mirror=StoreMirror(store))
    assert other_tenant.lookup(source, dtype="float32") is None  # namespaces stay apart in the store too

    store.delete(f"converted/t-a/{made.name}/{MANIFEST}")  # a push that died before its manifest
    third = ConvertedCache(tmp_path / "machine-4", namespace="t-a", mirror=StoreMirror(store))
    assert third.lookup(source, dtype="float32") is None
    with pytest.raises(AssertionError, match="converted again"):
        third.converted_source(source)
