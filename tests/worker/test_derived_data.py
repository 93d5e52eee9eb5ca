"""Data derived from a tenant's uploads and jobs is owned, counted and removed with its last owner.

- app.core.services.derived on SQLite and Postgres, with the local store and S3 (moto's ThreadedMotoServer): an
  entry needed by an upload and a job stays until both are gone, then leaves the store; usage counts
  it by kind until then; the retention sweep releases a job's needs as DELETE does.
- End to end (a real worker process, Postgres, Redis, the S3 store, the API in this process): a tenant
  uploads a GGUF model and token ids, runs a job (the worker converts the GGUF, fetches local copies of
  both uploads, makes an affinity entry), then deletes the job and both uploads: usage is 0, the bucket
  is empty, and after the owned sweep the worker's disk holds no copy, entry or work directory (the
  issue measured the converted copy, 6.2× the GGUF, the affinity entry and a 20 MB local copy surviving).
"""

from __future__ import annotations

import hashlib
import io
import os
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import DerivedData, Job, database
from app.core.migrate import upgrade
from app.core.services import derived
from app.core.services.usage import expire_finished, used_bytes
from app.core.storage.local import LocalStore
from app.core.storage.root import Storage
from tests.service_kit import WorkerProcess, make_settings, seed_finished_job, spec, wait_for, worker_settings
from worker.sweeps.owned import sweep_owned

BACKENDS = [pytest.param(("postgres", "local"), marks=[pytest.mark.postgres], id="postgres-local"),
            pytest.param(("sqlite", "local"), id="sqlite-local"), pytest.param(("sqlite", "s3"), id="sqlite-s3")]


@pytest.fixture(params=BACKENDS)
def world(request, tmp_path):
    database_kind, store = request.param
    overrides = {}
    if database_kind == "postgres":
        overrides = {"database_url": request.getfixturevalue("postgres_server").create_database("dtp_derived")}
    settings = make_settings(tmp_path, **overrides)
    upgrade(settings.database_url)
    objects = LocalStore(settings.storage)
    if store == "s3":
        s3 = request.getfixturevalue("s3_server")
        objects = s3.store(s3.create_bucket())
    return settings, database(settings.database_url), Storage(settings.storage, objects)


def put(storage: Storage, key: str, data: bytes) -> None:
    storage.root.mkdir(parents=True, exist_ok=True)
    path = storage.root / "tmp-put"
    path.write_bytes(data)
    storage.objects.put_file(path, key, sha256=hashlib.sha256(data).hexdigest())
    path.unlink()


def keys(storage: Storage, prefix: str) -> list[str]:
    return sorted(info.key for info in storage.objects.list_prefix(prefix))


def test_an_entry_goes_with_the_last_upload_or_job_that_needs_it(world):
    _settings, db, storage = world
    converted = "converted/t-x/" + "c" * 32 + "/"
    affinity = "affinity/t-x/" + "f" * 64 + "/"
    put(storage, converted + "model.safetensors", b"w" * 5000)
    put(storage, converted + "manifest.json", b"{}")
    put(storage, affinity + "affinity.safetensors", b"a" * 700)
    with db.session() as session:
        derived.record(session, owner="team-x", kind="converted", prefix=converted, size=5002,
                       needers=[derived.upload_needer("u" * 32), derived.job_needer("j1")])
        derived.record(session, owner="team-x", kind="affinity", prefix=affinity, size=700,
                       needers=[derived.job_needer("j1")])
        derived.record(session, owner="team-x", kind="affinity", prefix=affinity, size=700,  # a second job reuses it
                       needers=[derived.job_needer("j2")])
        assert {k: v for k, v in used_bytes(session, "team-x").items() if v} == {"converted": 5002, "affinity": 700}
        assert used_bytes(session, "team-y")["converted"] == 0  # another tenant's count is its own
        assert derived.release(session, storage.objects, derived.job_needer("j1")) == []  # both still needed
        assert keys(storage, "converted/") and keys(storage, "affinity/")
        assert derived.release(session, storage.objects, derived.upload_needer("u" * 32)) == [converted]
        assert keys(storage, "converted/") == [] and keys(storage, "affinity/")
        assert derived.release(session, storage.objects, derived.job_needer("j2")) == [affinity]
        assert keys(storage, "affinity/") == []
        assert sum(used_bytes(session, "team-x").values()) == 0
        assert session.query(DerivedData).count() == 0


def test_the_retention_sweep_releases_a_jobs_entries(world):
    settings, db, storage = world
    job_id, _ = seed_finished_job(settings, model_id="r-model", owner="team-r")
    affinity = "affinity/t-r/" + "e" * 64 + "/"
    put(storage, affinity + "affinity.safetensors", b"a" * 300)
    with db.session() as session:
        derived.record(session, owner="team-r", kind="affinity", prefix=affinity, size=300,
                       needers=[derived.job_needer(job_id)])
    with db.transaction() as session:
        session.get(Job, job_id).finished_at -= timedelta(days=3)
    assert job_id in expire_finished(db, storage, days=1)
    assert keys(storage, "affinity/") == []
    with db.session() as session:
        assert used_bytes(session, "team-r")["affinity"] == 0


def _gguf_bytes(path: Path) -> bytes:
    from tests.tiny import tiny_gguf

    tiny_gguf(path)
    return path.read_bytes()


def _npy_bytes() -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(3).integers(0, 97, size=4096).astype(np.int64))
    return buf.getvalue()


def _upload(client: TestClient, kind: str, name: str, data: bytes) -> dict:
    body = {"kind": kind, "name": name, "files": [{"path": name, "size": len(data),
                                                   "sha256": hashlib.sha256(data).hexdigest()}]}
    up = client.post("/v1/uploads", json=body).json()
    part = up["part_size"]
    for n in range(1, max(1, -(-len(data) // part)) + 1):
        r = client.put(f"/v1/uploads/{up['id']}/files/{name}/parts/{n}", content=data[(n - 1) * part:n * part])
        assert r.status_code == 204, r.text
    done = client.post(f"/v1/uploads/{up['id']}/complete")
    assert done.status_code == 200, done.text
    return done.json()


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_nothing_is_left_after_a_tenant_deletes_everything(tmp_path, postgres_server, redis_broker, s3_server,
                                                           s3_bucket):
    settings = worker_settings(tmp_path / "worker", postgres_server, redis_broker, "derived_e2e")
    s3_env = s3_server.env(s3_bucket)
    worker = WorkerProcess(settings, tmp_path / "worker.log", **s3_env).start(timeout=120)
    worker_side = settings.model_copy(update={"storage_url": s3_env["DTP_LAYOUT_STORAGE_URL"]})
    api_side = worker_side.model_copy(update={"var_dir": tmp_path / "api"})  # its own disk
    saved = os.environ.get("AWS_ENDPOINT_URL")
    os.environ["AWS_ENDPOINT_URL"] = s3_server.endpoint
    try:
        with TestClient(create_app(api_side)) as client:
            model = _upload(client, "model", "tiny.gguf", _gguf_bytes(tmp_path / "tiny.gguf"))
            data = _upload(client, "data", "ids.npy", _npy_bytes())
            job_id = client.post("/v1/jobs", json=spec(model={"id": model["ref"]},
                                                       calibration={"source": data["ref"], "sequences": 8,
                                                                    "seq_len": 32})).json()["id"]
            job = wait_for(client, job_id, timeout=300, worker=worker)
            assert job["status"] == "succeeded", (job, worker.log()[-3000:])
            usage = client.get("/v1/usage").json()
            assert usage["bytes"]["converted"] > model["size"] and usage["bytes"]["affinity"] > 0, usage
            assert usage["counts"]["derived"] == 2 and usage["bytes"]["reserved"] == 0  # the job ended
            root = settings.storage
            assert files_under(root / "cache" / "uploads") and files_under(root / "converted")
            assert any("/converted/" in k for k in s3_server.keys(s3_bucket))

            assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
            for up in (model, data):
                assert client.delete(f"/v1/uploads/{up['id']}").status_code == 204, up
            after = client.get("/v1/usage").json()
            assert after["used_bytes"] == 0 and after["counts"]["derived"] == 0, after
        assert s3_server.keys(s3_bucket) == []
        assert s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
        swept = sweep_owned(database(settings.database_url), Storage.from_settings(worker_side), open_ttl_s=3600,
                            grace_s=0)
        assert swept.local_removed >= 3  # two upload copies, the converted entry, the job's work directory
        for sub in ("cache", "converted", "jobs"):
            assert files_under(settings.storage / sub) == [], sub
    finally:
        worker.stop()
        if saved is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved


def test_the_owned_sweep_removes_local_copies_nobody_owns_and_keeps_the_rest(world):
    from app.core.db import Upload, utcnow

    settings, db, storage = world
    root = storage.root
    kept_upload, live_job = "a" * 32, seed_job_row(settings, "succeeded")
    expired_job = seed_job_row(settings, "succeeded", expired=True)
    with db.transaction() as session:
        session.add(Upload(id=kept_upload, owner="team-s", kind="data", name="k", status="complete", part_size=1,
                           size=1, charged=1, storage_prefix="uploads/x/" + kept_upload, created_at=utcnow()))
    recorded = "b" * 32
    with db.session() as session:
        derived.record(session, owner="team-s", kind="converted", prefix=f"converted/t-s/{recorded}/", size=1,
                       needers=[derived.upload_needer(kept_upload)])
    made = {
        "cache/uploads/" + kept_upload + "/ids.npy": True, "cache/uploads/" + "c" * 32 + "/ids.npy": False,
        f"converted/t-s/{recorded}/manifest.json": True, "converted/t-s/" + "d" * 32 + "/manifest.json": False,
        f"jobs/{live_job}/work/1/blocks.npy": True, f"jobs/{expired_job}/work/1/blocks.npy": False,
    }
    for rel in made:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    (root / "converted/t-s" / f".{'d' * 32}.lock").write_bytes(b"")
    young = sweep_owned(db, storage, open_ttl_s=3600)  # everything younger than the grace period: kept
    assert young.local_removed == 0 and all((root / rel).exists() for rel in made)
    swept = sweep_owned(db, storage, open_ttl_s=3600, grace_s=0)
    assert swept.local_removed == 3
    assert {rel: (root / rel).exists() for rel in made} == made
    assert not (root / "converted/t-s" / f".{'d' * 32}.lock").exists()


def seed_job_row(settings, status: str, *, expired: bool = False) -> str:
    from app.core.db import utcnow
    from tests.service_kit import seed_job

    job_id = seed_job(settings, status="cancelled")
    with database(settings.database_url).transaction() as session:
        job = session.get(Job, job_id)
        job.status = status
        if expired:
            job.expired_at, job.expired_reason = utcnow(), "deleted"
    return job_id
