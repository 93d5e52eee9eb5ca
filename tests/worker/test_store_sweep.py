"""worker.sweeps.store on both stores (the local directory and a real S3 API server, moto's
ThreadedMotoServer), over a migrated SQLite database: stale multipart uploads aborted, fresh ones kept;
objects of ended or deleted jobs that no artifact row lists removed, listed ones and those of active jobs
kept, work directories never touched."""

from __future__ import annotations

import io
import time

import pytest

from app.core.db import Artifact, Upload, UploadFile, database, utcnow
from app.core.migrate import upgrade
from app.core.storage.local import LocalStore
from app.core.storage.root import Storage
from tests.service_kit import make_settings, seed_finished_job, seed_job
from worker.sweeps.store import sweep_store


@pytest.fixture(params=["local", "s3"])
def world(request, tmp_path):
    settings = make_settings(tmp_path / "var")
    settings.var_dir.mkdir(parents=True)
    upgrade(settings.database_url)
    if request.param == "local":
        objects = LocalStore(settings.storage)
    else:
        server = request.getfixturevalue("s3_server")
        objects = server.store(server.create_bucket())
    return settings, objects


def test_sweep_removes_what_no_row_lists_of_ended_jobs_and_aborts_stale_uploads(world, tmp_path):
    settings, objects = world
    db = database(settings.database_url)
    ended, _ = seed_finished_job(settings, model_id="tiny")  # rows for jobs/<id>/artifacts/{report.json,…}
    running = seed_job(settings, status="running")
    with db.session() as session:
        listed = {a.storage_key for a in session.query(Artifact).filter(Artifact.job_id == ended)}
    src = tmp_path / "f"
    src.write_bytes(b"object")
    for key in listed:
        objects.put_file(src, key)  # (S3: the seeded rows' objects; local: already there, rewritten)
    orphan = Storage.artifact_key(ended, "report.json", attempt=2)  # a lost run's copy
    unrecorded = Storage.artifact_key(running, "report.json")  # about to be recorded: kept
    gone = Storage.artifact_key("0" * 32, "x.bin")  # a deleted job's
    for key in (orphan, unrecorded, gone):
        objects.put_file(src, key)
    work = settings.storage / "jobs" / ended / "work" / "1" / "blocks.npy"
    work.parent.mkdir(parents=True, exist_ok=True)
    work.write_bytes(b"scratch")
    stale = objects.begin_multipart(Storage.artifact_key(running, "shards/big.bin"))
    objects.put_part(Storage.artifact_key(running, "shards/big.bin"), stale, 1, io.BytesIO(b"p"), 1)
    time.sleep(1.1)
    fresh = objects.begin_multipart("uploads/t/u/model.safetensors")

    swept = sweep_store(db, objects, stale_s=1.0)

    assert swept.removed == 2
    if isinstance(objects, LocalStore):
        assert swept.aborted == 1 and [u.upload_id for u in objects.list_multipart("")] == [fresh]
    else:  # moto lists every upload as initiated on 2010-11-10 (its template's constant): both are stale
        assert swept.aborted == 2 and objects.list_multipart("") == [] and fresh
    keys = {i.key for i in objects.list_prefix("jobs/")} - {
        i.key for i in objects.list_prefix(f"jobs/{ended}/work/")}
    assert keys == listed | {unrecorded}
    assert work.read_bytes() == b"scratch"
    assert sweep_store(db, objects, stale_s=1.0).removed == 0  # idempotent


def test_a_declared_uploads_multipart_is_left_to_the_owned_sweep_whatever_the_stores_clock_says(world):
    """The store's "initiated" time cannot abort a live client upload: moto reports every multipart upload
    as begun in 2010, so before this rule a worker's sweep aborted a tenant's upload between its last part
    and its completion (CI: 'its parts are no longer in the store'). The undeclared one (an API killed
    between beginning it and writing the rows) is still aborted."""
    settings, objects = world
    db = database(settings.database_url)
    declared = objects.begin_multipart("uploads/t/u1/files/model.safetensors")
    objects.put_part("uploads/t/u1/files/model.safetensors", declared, 1, io.BytesIO(b"p"), 1)
    with db.session() as session, session.begin():
        session.add(Upload(id="u1", owner="t", kind="model", name="m", status="open", part_size=1, size=1,
                           charged=1, storage_prefix="uploads/t/u1", created_at=utcnow()))
        session.flush()
        session.add(UploadFile(upload_id="u1", index=0, path="model.safetensors", size=1, sha256="0" * 64,
                               multipart=declared, done=False))
    orphan = objects.begin_multipart("uploads/t/u2/files/model.safetensors")
    time.sleep(1.1)

    swept = sweep_store(db, objects, stale_s=1.0)

    assert swept.aborted == 1 and orphan
    assert [u.upload_id for u in objects.list_multipart("")] == [declared]
    assert [p.number for p in objects.list_parts("uploads/t/u1/files/model.safetensors", declared)] == [1]


def test_the_sweeper_aborts_an_undeclared_upload_only_once_stale_by_its_own_clock_too(world):
    """The API begins a file's multipart upload a moment before it writes the row naming it; a worker's sweep
    in that moment, on a store whose clock says the upload is old (moto: 2010-11-10), aborted a tenant's live
    upload (a full suite, moto then answering its part with a 500). With the sweeper's `seen`, an undeclared
    upload goes only once stale by the time this process first listed it as well."""
    settings, objects = world
    db = database(settings.database_url)
    begun = objects.begin_multipart("uploads/t/u3/files/model.safetensors")
    time.sleep(1.1)  # stale by the store's clock (moto's at once)
    seen: dict[str, float] = {}

    first = sweep_store(db, objects, stale_s=1.0, seen=seen)

    assert first.aborted == 0 and [u.upload_id for u in objects.list_multipart("")] == [begun]
    assert list(seen) == [begun]
    time.sleep(1.1)
    assert sweep_store(db, objects, stale_s=1.0, seen=seen).aborted == 1  # an orphan still goes, a sweep later
    assert objects.list_multipart("") == []
    sweep_store(db, objects, stale_s=1.0, seen=seen)
    assert seen == {}  # what the store no longer lists is forgotten


def test_local_sweep_removes_old_temporaries(tmp_path):
    settings = make_settings(tmp_path / "var")
    settings.var_dir.mkdir(parents=True)
    upgrade(settings.database_url)
    objects = LocalStore(settings.storage)
    tmp = objects.root / ".staging" / "tmp"
    tmp.mkdir(parents=True)
    (tmp / "put-killed").write_bytes(b"half")
    time.sleep(1.1)
    (tmp / "put-now").write_bytes(b"in flight")
    swept = sweep_store(database(settings.database_url), objects, stale_s=1.0)
    assert swept.temporaries == 1 and [p.name for p in tmp.iterdir()] == ["put-now"]
