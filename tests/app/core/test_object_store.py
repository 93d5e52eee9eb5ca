"""The object store's contract, held by both implementations: the local directory and S3 (a real S3 API
server in this process, moto's ThreadedMotoServer). Every digest is computed here with hashlib over the
bytes the test wrote, never taken from the store."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from app.core.storage.local import LocalStore
from app.core.storage.object_store import (
    MIN_PART_BYTES,
    BadPart,
    ObjectChanged,
    ObjectMissing,
    ObjectStore,
    check_key,
    parse_url,
)
from app.core.storage.s3 import S3Store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> ObjectStore:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    server = request.getfixturevalue("s3_server")
    return server.store(server.create_bucket())


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_put_head_read_ranges_fetch(store, tmp_path):
    data = os.urandom(3 * (1 << 20) + 123)  # several read chunks
    info = store.put_file(write(tmp_path / "a.bin", data), "jobs/j1/artifacts/a.bin")
    assert info.size == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()
    head = store.head("jobs/j1/artifacts/a.bin")
    assert head is not None and head.size == len(data) and head.etag == info.etag
    assert b"".join(store.read("jobs/j1/artifacts/a.bin")) == data
    assert b"".join(store.read("jobs/j1/artifacts/a.bin", 5, 100)) == data[5:105]
    assert b"".join(store.read("jobs/j1/artifacts/a.bin", len(data) - 7)) == data[-7:]
    assert b"".join(store.read("jobs/j1/artifacts/a.bin", 0, 10, etag=info.etag)) == data[:10]
    out = store.fetch("jobs/j1/artifacts/a.bin", tmp_path / "dl" / "a.bin")
    assert (tmp_path / "dl" / "a.bin").read_bytes() == data and out.size == len(data)
    assert store.head("jobs/j1/artifacts/none") is None
    with pytest.raises(ObjectMissing):
        b"".join(store.read("jobs/j1/artifacts/none"))
    with pytest.raises(ObjectMissing):
        store.fetch("jobs/j1/artifacts/none", tmp_path / "x")


def test_replaced_object_changes_etag_and_fails_if_match(store, tmp_path):
    first = store.put_file(write(tmp_path / "a", b"one"), "k/a")
    second = store.put_file(write(tmp_path / "a", b"two!"), "k/a")
    assert first.etag != second.etag
    with pytest.raises(ObjectChanged):
        b"".join(store.read("k/a", etag=first.etag))
    assert b"".join(store.read("k/a")) == b"two!"


def test_list_sizes_delete_and_delete_prefix(store, tmp_path):
    for key, n in [("jobs/a/artifacts/x", 10), ("jobs/a/artifacts/y", 20), ("jobs/ab/artifacts/z", 5),
                   ("affinity/t/f/affinity.safetensors", 7)]:
        store.put_file(write(tmp_path / "f", b"x" * n), key)
    listed = {i.key: i.size for i in store.list_prefix("jobs/a/")}
    assert listed == {"jobs/a/artifacts/x": 10, "jobs/a/artifacts/y": 20}
    assert sum(i.size for i in store.list_prefix("")) == 42
    store.delete("jobs/a/artifacts/x")
    store.delete("jobs/a/artifacts/x")  # absent: no error
    assert [i.key for i in store.list_prefix("jobs/a/")] == ["jobs/a/artifacts/y"]
    assert store.delete_prefix("jobs/") == 2
    assert [i.key for i in store.list_prefix("")] == ["affinity/t/f/affinity.safetensors"]


def test_multipart_out_of_order_resent_parts_complete(store, tmp_path):
    parts_data = [os.urandom(MIN_PART_BYTES), os.urandom(MIN_PART_BYTES), b"tail"]
    uid = store.begin_multipart("uploads/t/u1/model.safetensors")
    assert [u.upload_id for u in store.list_multipart("uploads/")] == [uid]
    sent = {}
    for number in (3, 1, 2, 1):  # out of order; part 1 twice (a resumed client)
        data = parts_data[number - 1]
        sent[number] = store.put_part("uploads/t/u1/model.safetensors", uid, number, io.BytesIO(data + b"extra"),
                                      len(data))
    assert sorted(p.number for p in store.list_parts("uploads/t/u1/model.safetensors", uid)) == [1, 2, 3]
    assert store.head("uploads/t/u1/model.safetensors") is None  # nothing visible before completion
    info = store.complete_multipart("uploads/t/u1/model.safetensors", uid, [sent[1], sent[2], sent[3]])
    whole = b"".join(parts_data)
    assert info.size == len(whole)
    assert hashlib.sha256(b"".join(store.read("uploads/t/u1/model.safetensors"))).digest() == \
        hashlib.sha256(whole).digest()
    assert store.list_multipart("") == []


def test_multipart_refusals_and_abort(store):
    uid = store.begin_multipart("uploads/t/u2/data.txt")
    small = store.put_part("uploads/t/u2/data.txt", uid, 1, io.BytesIO(b"a" * 10), 10)
    last = store.put_part("uploads/t/u2/data.txt", uid, 2, io.BytesIO(b"b" * 10), 10)
    with pytest.raises(BadPart, match="at least"):
        store.complete_multipart("uploads/t/u2/data.txt", uid, [small, last])
    with pytest.raises(BadPart, match="ascending"):
        store.complete_multipart("uploads/t/u2/data.txt", uid, [last, small])
    with pytest.raises(BadPart, match="outside"):
        store.put_part("uploads/t/u2/data.txt", uid, 0, io.BytesIO(b"x"), 1)
    with pytest.raises(BadPart, match="announced"):
        store.put_part("uploads/t/u2/data.txt", uid, 3, io.BytesIO(b"xy"), 5)
    store.abort_multipart("uploads/t/u2/data.txt", uid)
    store.abort_multipart("uploads/t/u2/data.txt", uid)  # gone already: no error
    assert store.list_multipart("") == []
    if isinstance(store, LocalStore):  # moto answers a part sent to an aborted upload with a 500 (S3: NoSuchUpload)
        with pytest.raises(ObjectMissing):
            store.put_part("uploads/t/u2/data.txt", uid, 1, io.BytesIO(b"x"), 1)
    assert store.head("uploads/t/u2/data.txt") is None


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", ".staging/x", "a/./b", "a/.hidden", "a\x00b"])
def test_keys_that_are_not_plain_paths_are_refused(store, key, tmp_path):
    with pytest.raises(ValueError):
        store.put_file(write(tmp_path / "f", b"x"), key)
    with pytest.raises(ValueError):
        check_key(key)


def test_presign_only_on_s3(store):
    url = store.presign_get("jobs/j/artifacts/a", expires_s=60)
    assert (url is None) == isinstance(store, LocalStore)


@pytest.mark.parametrize("url", ["s3://", "http://b/p", "s3://b/p?x=1", "s3://b/../p", "b/p"])
def test_bad_storage_urls(url):
    with pytest.raises(ValueError, match="s3://"):
        parse_url(url)


def test_storage_url_parsed_into_bucket_and_prefix():
    assert parse_url("s3://bucket/some/prefix/") == ("bucket", "some/prefix")
    assert parse_url("s3://bucket") == ("bucket", "")
    assert isinstance(S3Store("bucket", "p", client=object()), ObjectStore)
