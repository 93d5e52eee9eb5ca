"""Uploads through the API, on SQLite and on the real Postgres: a model directory and data files declared,
sent part by part (resumed from what GET says is in), completed with each sha256 verified and the
model's config checked; hostile declarations and parts refused naming what is wrong; tenants see only
their own uploads (404 on the API, 422 in a job spec); quotas (413/429), /v1/usage, DELETE of jobs and
uploads (409 while in use, objects gone after) and the retention sweep."""

from __future__ import annotations

import hashlib
import os
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Job, database
from app.core.keys import create_key
from app.core.migrate import upgrade
from app.core.services.usage import expire_finished
from app.core.storage.root import Storage
from tests.service_kit import make_settings, provision, seed_finished_job, seed_job, spec

# (database, store): the store is the storage root, or an S3 bucket on moto's ThreadedMotoServer
BACKENDS = [pytest.param(("postgres", "local"), marks=[pytest.mark.postgres], id="postgres-local"),
            pytest.param(("sqlite", "local"), id="sqlite-local"), pytest.param(("sqlite", "s3"), id="sqlite-s3")]
PART = 5 << 20  # the smallest part size the settings take (S3's floor): multi-part files stay small


class Objects:
    """The store's objects as the test sees them, not through the code under test: the files under the
    storage root, or the bucket's keys listed with boto3."""

    def __init__(self, root: Path, s3=None, bucket: str | None = None) -> None:
        self.root, self.s3, self.bucket = root, s3, bucket

    def of(self, upload_id: str) -> dict[str, bytes]:
        """name → bytes of every stored object of the upload (multipart parts in progress excluded)."""
        if self.s3 is None:
            return {p.name: p.read_bytes() for p in sorted((self.root / "uploads").rglob("*"))
                    if p.is_file() and upload_id in str(p)}
        client = self.s3.client()
        return {k.rsplit("/", 1)[-1]: client.get_object(Bucket=self.bucket, Key=k)["Body"].read()
                for k in self.s3.keys(self.bucket) if upload_id in k}

    def pending(self, upload_id: str) -> int:
        """Multipart uploads still open for the upload's files."""
        if self.s3 is None:
            staging = self.root / ".staging" / "multipart"
            return sum(1 for d in staging.iterdir() if upload_id in (d / "key").read_text()) if staging.is_dir() else 0
        answer = self.s3.client().list_multipart_uploads(Bucket=self.bucket)
        return sum(1 for u in answer.get("Uploads", []) if upload_id in u["Key"])

    def job(self, job_id: str) -> list[str]:
        if self.s3 is None:
            return [str(p) for p in (self.root / "jobs" / job_id).rglob("*") if p.is_file()]
        return [k for k in self.s3.keys(self.bucket) if f"jobs/{job_id}/" in k]


@pytest.fixture(scope="module", params=BACKENDS)
def world(request, tmp_path_factory):
    database_kind, store = request.param
    root = tmp_path_factory.mktemp(f"uploads-{database_kind}-{store}")
    overrides = {}
    if database_kind == "postgres":
        server = request.getfixturevalue("postgres_server")
        overrides = {"database_url": server.create_database("dtp_uploads")}
    saved = os.environ.get("AWS_ENDPOINT_URL")
    objects = Objects(root / "storage")
    if store == "s3":
        s3 = request.getfixturevalue("s3_server")
        bucket = s3.create_bucket()
        os.environ["AWS_ENDPOINT_URL"] = s3.endpoint  # boto3 in this process (the app's store)
        overrides["storage_url"] = f"s3://{bucket}/dtp"
        objects = Objects(root / "storage", s3, bucket)
    settings = make_settings(root, key_cache_s=0, max_active_jobs=50, upload_part_bytes=PART,
                             upload_max_bytes=64 << 20, **overrides)
    upgrade(settings.database_url)
    provision(settings)
    db = database(settings.database_url)
    keys = {"alice": create_key(db, name="alice", tenant="team-a"), "bob": create_key(db, name="bob", tenant="team-b")}
    try:
        with TestClient(create_app(settings)) as client:
            yield settings, client, keys, objects
    finally:
        if saved is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny llama as a Hugging Face directory (config.json, model.safetensors, generation_config.json)."""
    from tests.tiny import tiny_model

    path = tmp_path_factory.mktemp("tiny-upload")
    tiny_model("llama").save_pretrained(path)
    return path


def as_(keys, who):
    return {"X-API-Key": keys[who]}


def declare(client, headers, kind, files, name="x"):
    body = {"kind": kind, "name": name,
            "files": [{"path": p, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for p, b in files.items()]}
    return client.post("/v1/uploads", json=body, headers=headers)


def put(client, headers, upload_id, path, n, data):
    return client.put(f"/v1/uploads/{upload_id}/files/{path}/parts/{n}", content=data, headers=headers)


def send_all(client, headers, upload, files, part=PART):
    for path, data in files.items():
        for n in range(1, max(1, -(-len(data) // part)) + 1):
            r = put(client, headers, upload["id"], path, n, data[(n - 1) * part:n * part])
            assert r.status_code == 204, r.text
            assert r.headers["X-Part-SHA256"] == hashlib.sha256(data[(n - 1) * part:n * part]).hexdigest()


def upload(client, headers, kind, files, name="x"):
    r = declare(client, headers, kind, files, name)
    assert r.status_code == 201, r.text
    send_all(client, headers, r.json(), files)
    done = client.post(f"/v1/uploads/{r.json()['id']}/complete", headers=headers)
    assert done.status_code == 200, done.text
    return done.json()


def model_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def npy_bytes(arr) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


# ---- the happy path, and resume --------------------------------------------------------------------------

def test_a_model_directory_and_data_upload_complete_and_a_job_names_them(world, tiny_dir):
    _settings, client, keys, objects = world
    files = model_files(tiny_dir)
    model = upload(client, as_(keys, "alice"), "model", files, name="tiny")
    assert model["status"] == "complete" and model["ref"] == f"upload:{model['id']}"
    assert model["config"]["num_key_value_heads"] == 4 and model["received_bytes"] == sum(map(len, files.values()))
    assert objects.of(model["id"]) == files  # the assembled files are the bytes sent
    assert objects.pending(model["id"]) == 0  # no multipart upload left open
    data = upload(client, as_(keys, "alice"), "data",
                  {"ids.npy": npy_bytes(np.random.default_rng(0).integers(0, 97, 4096))})
    r = client.post("/v1/jobs", json=spec(model={"id": model["ref"]}, calibration={"source": data["ref"]}),
                    headers=as_(keys, "alice"))
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.json()["spec"]["model"]["id"] == model["ref"]
    listing = client.get("/v1/uploads", headers=as_(keys, "alice")).json()["items"]
    assert {model["id"], data["id"]} <= {u["id"] for u in listing}
    # in use: 409 naming the job; the job cancelled, the upload goes
    r = client.delete(f"/v1/uploads/{model['id']}", headers=as_(keys, "alice"))
    assert r.status_code == 409 and r.json()["field"] == "upload_id" and job_id in r.json()["detail"]
    assert client.post(f"/v1/jobs/{job_id}/cancel", headers=as_(keys, "alice")).status_code == 202
    assert client.delete(f"/v1/uploads/{model['id']}", headers=as_(keys, "alice")).status_code == 204
    assert objects.of(model["id"]) == {}
    assert client.get(f"/v1/uploads/{model['id']}", headers=as_(keys, "alice")).status_code == 404


def test_a_multi_part_file_resumes_from_the_parts_the_server_has(world):
    _settings, client, keys, objects = world
    data = os.urandom(2 * PART + 12345)  # 3 parts
    files = {"big.txt": data}
    r = declare(client, as_(keys, "alice"), "data", files)
    up = r.json()
    assert up["files"][0]["parts"] == 3 and up["files"][0]["parts_received"] == []
    assert put(client, as_(keys, "alice"), up["id"], "big.txt", 3, data[2 * PART:]).status_code == 204
    assert put(client, as_(keys, "alice"), up["id"], "big.txt", 1, data[:PART]).status_code == 204
    seen = client.get(f"/v1/uploads/{up['id']}", headers=as_(keys, "alice")).json()
    assert seen["files"][0]["parts_received"] == [1, 3] and seen["received_bytes"] == PART + len(data) - 2 * PART
    early = client.post(f"/v1/uploads/{up['id']}/complete", headers=as_(keys, "alice"))
    assert early.status_code == 409 and "parts 2 of 3" in early.json()["detail"]
    # a part sent again replaces itself; the missing one completes the file
    assert put(client, as_(keys, "alice"), up["id"], "big.txt", 1, data[:PART]).status_code == 204
    assert put(client, as_(keys, "alice"), up["id"], "big.txt", 2, data[PART:2 * PART]).status_code == 204
    done = client.post(f"/v1/uploads/{up['id']}/complete", headers=as_(keys, "alice")).json()
    assert done["status"] == "complete" and done["files"][0]["done"]
    assert objects.of(done["id"]) == {"big.txt": data} and objects.pending(done["id"]) == 0
    again = put(client, as_(keys, "alice"), up["id"], "big.txt", 1, data[:PART])
    assert again.status_code == 409  # complete: immutable


# ---- hostile declarations and parts ---------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "path", "words"), [
    ("model", "../config.json", "plain file name"), ("model", "sub/config.json", "plain file name"),
    ("model", ".hidden", "plain file name"), ("model", "pytorch_model.bin", "pickle"),
    ("model", "weights.pt", "pickle"), ("data", "ids.pkl", "pickle"), ("model", "run.sh", "not a file a model"),
    ("data", "data.csv", "not a data file"), ("data", "a\x00b.txt", "plain file name"),
    ("model", "x" * 201 + ".json", "200 characters"),
])
def test_bad_names_and_kinds_are_422_naming_the_file(world, kind, path, words):
    _settings, client, keys, _objects = world
    files = {"config.json": b"{}", "model.safetensors": b"x", path: b"payload"} if kind == "model" else {path: b"x"}
    r = declare(client, as_(keys, "alice"), kind, files)
    assert r.status_code == 422, r.text
    assert any(words in e["msg"] for e in r.json()["detail"]), r.json()


def test_declarations_out_of_bounds_are_refused(world):
    settings, client, keys, _objects = world
    h = as_(keys, "alice")
    sha = "0" * 64
    cases = [
        ({"kind": "weights", "name": "x", "files": [{"path": "a.txt", "size": 1, "sha256": sha}]}, 422, "kind"),
        ({"kind": "data", "name": "x", "files": []}, 422, "files"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.txt", "size": -1, "sha256": sha}]}, 422, "files.0.size"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.txt", "size": 1, "sha256": "XYZ"}]}, 422,
         "files.0.sha256"),
        ({"kind": "data", "name": "../x", "files": [{"path": "a.txt", "size": 1, "sha256": sha}]}, 422, "name"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.txt", "size": 1, "sha256": sha}] * 2}, 422,
         "files.1.path"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.npy", "size": 1, "sha256": sha},
                                                  {"path": "b.txt", "size": 1, "sha256": sha}]}, 422, "files"),
        ({"kind": "model", "name": "x", "files": [{"path": "model.safetensors", "size": 1, "sha256": sha}]}, 422,
         "files"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.txt", "size": settings.upload_max_bytes + 1,
                                                   "sha256": sha}]}, 413, "files"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.txt", "size": PART * 10_001, "sha256": sha}]}, 422,
         "files.0.size"),
        ({"kind": "data", "name": "x", "files": [{"path": "a.txt", "size": 1, "sha256": sha}], "extra": 1}, 422,
         "extra"),
    ]
    for body, status, field in cases:
        r = client.post("/v1/uploads", json=body, headers=h)
        assert r.status_code == status, (body, r.text)
        fields = [e["field"] for e in r.json()["detail"]] if status == 422 else [r.json()["field"]]
        assert any(f.startswith(field) for f in fields), (body, r.json())


def test_bad_parts_are_refused_and_nothing_of_them_is_kept(world):
    settings, client, keys, objects = world
    h = as_(keys, "alice")
    data = os.urandom(PART + 10)
    up = declare(client, h, "data", {"a.txt": data}).json()
    for n in (0, 3, -1):
        r = put(client, h, up["id"], "a.txt", n, b"x")
        assert r.status_code == 422 and r.json()["detail"][0]["field"] == "n", r.text
    r = put(client, h, up["id"], "a.txt", 2, b"short")  # the last part is 10 bytes
    assert r.status_code == 422 and "exactly 10 bytes" in r.json()["message"]
    r = put(client, h, up["id"], "a.txt", 2, b"x" * 11)
    assert r.status_code == 422
    r = put(client, h, up["id"], "a.txt", 1, os.urandom(PART + 1))  # past the part size: refused before it is read
    assert r.status_code == 413 and "UPLOAD_PART_BYTES" in r.json()["detail"]
    assert put(client, h, up["id"], "b.txt", 1, b"x").status_code == 404
    assert put(client, h, up["id"], "..%2Fa.txt", 1, b"x").status_code == 404
    assert put(client, h, uuid.uuid4().hex, "a.txt", 1, b"x").status_code == 404
    assert put(client, h, "not-an-id", "a.txt", 1, b"x").status_code == 404
    assert client.get(f"/v1/uploads/{up['id']}", headers=h).json()["files"][0]["parts_received"] == []
    assert objects.of(up["id"]) == {}
    spool = Storage(settings.storage).root / "tmp" / "upload-parts"
    assert not list(spool.iterdir())


def test_a_wrong_sha256_is_422_at_completion_and_the_file_can_be_sent_again(world):
    _settings, client, keys, objects = world
    h = as_(keys, "alice")
    data = os.urandom(PART + 100)
    up = declare(client, h, "data", {"a.txt": data}).json()
    tampered = bytearray(data)
    tampered[PART + 5] ^= 1
    send_all(client, h, up, {"a.txt": bytes(tampered)})
    r = client.post(f"/v1/uploads/{up['id']}/complete", headers=h)
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "files.0.sha256"
    assert hashlib.sha256(bytes(tampered)).hexdigest() in r.json()["message"]
    seen = client.get(f"/v1/uploads/{up['id']}", headers=h).json()
    assert seen["status"] == "open" and seen["files"][0]["parts_received"] == [] and objects.of(up["id"]) == {}
    send_all(client, h, up, {"a.txt": data})
    assert client.post(f"/v1/uploads/{up['id']}/complete", headers=h).json()["status"] == "complete"


def test_model_contents_are_checked_at_completion_and_a_refused_model_is_removed(world, tiny_dir):
    _settings, client, keys, objects = world
    h = as_(keys, "alice")
    files = model_files(tiny_dir)
    import json

    huge = json.loads(files["config.json"])
    huge["num_attention_heads"] = 1 << 40
    cases = [({**files, "config.json": json.dumps(huge).encode()}, "num_attention_heads"),
             ({**files, "config.json": b"not json"}, "not JSON"),
             ({**files, "model.safetensors": b"\x80\x04\x95" + os.urandom(64)}, "not a safetensors file")]
    for bad, words in cases:
        up = declare(client, h, "model", bad).json()
        send_all(client, h, up, bad)
        r = client.post(f"/v1/uploads/{up['id']}/complete", headers=h)
        assert r.status_code == 422 and words in r.json()["message"], r.text
        assert client.get(f"/v1/uploads/{up['id']}", headers=h).status_code == 404
        assert objects.of(up["id"]) == {} and objects.pending(up["id"]) == 0
    import io

    head = io.BytesIO()  # the header of a pickled object array (its body would be a pickle)
    np.lib.format.write_array_header_1_0(head, {"descr": "|O", "fortran_order": False, "shape": (1,)})
    objects = head.getvalue() + b"\x80\x04K\x01."
    for data in (npy_bytes(np.array([1.5, 2.5])), objects, b"not a npy file"):
        up = declare(client, h, "data", {"ids.npy": data}).json()
        send_all(client, h, up, {"ids.npy": data})
        r = client.post(f"/v1/uploads/{up['id']}/complete", headers=h)
        assert r.status_code == 422 and "ids.npy" in r.json()["message"], r.text


# ---- tenants -----------------------------------------------------------------------------------------------

def test_another_tenant_gets_404_on_the_api_and_422_in_a_job_spec(world):
    _settings, client, keys, _objects = world
    up = upload(client, as_(keys, "alice"), "data", {"ids.npy": npy_bytes(np.arange(300) % 97)})
    missing = uuid.uuid4().hex
    for method, path in (("get", "/v1/uploads/{}"), ("delete", "/v1/uploads/{}"), ("post", "/v1/uploads/{}/complete"),
                         ("put", "/v1/uploads/{}/files/ids.npy/parts/1")):
        other = client.request(method.upper(), path.format(up["id"]), headers=as_(keys, "bob"), content=b"x")
        nothing = client.request(method.upper(), path.format(missing), headers=as_(keys, "bob"), content=b"x")
        assert other.status_code == nothing.status_code == 404, (path, other.text)
        assert other.json()["detail"].replace(up["id"], "ID") == nothing.json()["detail"].replace(missing, "ID")
    assert up["id"] not in {u["id"] for u in client.get("/v1/uploads", headers=as_(keys, "bob")).json()["items"]}
    for body, field in ((spec(calibration={"source": up["ref"]}), "calibration.source"),
                        (spec(model={"id": up["ref"]}), "model.id"),
                        (spec(distill={"layouts": ["optimised"], "steps": 2, "train": {"source": up["ref"]}}),
                         "distill.train.source")):
        r = client.post("/v1/jobs", json=body, headers=as_(keys, "bob"))
        assert r.status_code == 422 and field in [e["field"] for e in r.json()["detail"]], r.text
        assert "no upload" in r.json()["message"]
    # the owner: a data upload is not a model, an open upload is not usable
    r = client.post("/v1/jobs", json=spec(model={"id": up["ref"]}), headers=as_(keys, "alice"))
    assert r.status_code == 422 and "is data, not model" in r.json()["message"]
    opened = declare(client, as_(keys, "alice"), "data", {"x.txt": b"hello"}).json()
    r = client.post("/v1/jobs", json=spec(calibration={"source": f"upload:{opened['id']}"}), headers=as_(keys, "alice"))
    assert r.status_code == 422 and "not complete" in r.json()["message"]
    r = client.post("/v1/jobs", json=spec(calibration={"source": "upload:../../etc"}), headers=as_(keys, "alice"))
    assert r.status_code == 422 and "32 hex digits" in r.json()["message"]


# ---- quotas, usage, delete, retention ----------------------------------------------------------------------

def test_quota_413_and_429_name_the_quota_used_and_asked(world):
    settings, _client, _keys, _objects = world
    tight = settings.model_copy(update={"storage_quotas": "team-q=3000", "upload_min_file_bytes": 0})
    db = database(settings.database_url)
    key = create_key(db, name=f"q{uuid.uuid4().hex[:8]}", tenant="team-q")
    with TestClient(create_app(tight)) as c:
        h = {"X-API-Key": key}
        r = declare(c, h, "data", {"big.txt": b"x" * 3001})
        assert r.status_code == 413 and r.json()["field"] == "files"
        assert "3000" in r.json()["detail"] and "3001 asked" in r.json()["detail"]
        first = upload(c, h, "data", {"a.txt": b"y" * 2000})
        r = declare(c, h, "data", {"b.txt": b"z" * 1500})
        assert r.status_code == 429 and r.json()["error"] == "storage_quota" and "Retry-After" in r.headers
        assert "2000 bytes used, 1500 asked" in r.json()["detail"]
        usage = c.get("/v1/usage", headers=h).json()
        assert usage == {"tenant": "team-q", "quota_bytes": 3000, "used_bytes": 2000,
                         "bytes": {"uploads_model": 0, "uploads_data": 2000, "artifacts": 0, "reserved": 0,
                                   "converted": 0, "affinity": 0},
                         "counts": {"uploads_open": 0, "uploads_complete": 1, "jobs": 0, "jobs_expired": 0,
                                    "artifacts": 0, "derived": 0}, "retention_days": 0.0}
        # a finished job's artifacts count; a job whose expected artifacts do not fit is refused before it runs
        # 5033 bytes of artifacts: a 33-byte report.json, 5000 random bytes
        job_id, _ = seed_finished_job(settings, model_id="q-model", owner="team-q")
        assert c.get("/v1/usage", headers=h).json()["bytes"]["artifacts"] == 5033
        r = c.post("/v1/jobs", json=spec(), headers=h)
        assert r.status_code == 413 and r.json()["field"] == "quota" and "expected" in r.json()["detail"], r.text
        assert c.delete(f"/v1/jobs/{job_id}", headers=h).status_code == 200
        assert c.delete(f"/v1/uploads/{first['id']}", headers=h).status_code == 204
        assert c.get("/v1/usage", headers=h).json()["used_bytes"] == 0
    roomy = settings.model_copy(update={"storage_quotas": f"team-q={8 << 20}"})
    with TestClient(create_app(roomy)) as c:
        r = c.post("/v1/jobs", json=spec(), headers=h)
        assert r.status_code == 202, r.text
        reserved = c.get("/v1/usage", headers=h).json()["bytes"]["reserved"]
        assert reserved >= 1 << 20  # the job's expected artifacts, held while it is queued


def test_delete_job_removes_its_artifacts_and_downloads_are_410(world):
    settings, client, keys, objects = world
    h = as_(keys, "alice")
    running = seed_job(settings, status="running", owner="team-a")
    queued = seed_job(settings, status="queued", owner="team-a")
    for job_id, status in ((running, "running"), (queued, "queued")):
        r = client.delete(f"/v1/jobs/{job_id}", headers=h)
        assert r.status_code == 409 and status in r.json()["detail"]
    job_id, _ = seed_finished_job(settings, model_id="del-model", owner="team-a")
    assert client.delete(f"/v1/jobs/{job_id}", headers=as_(keys, "bob")).status_code == 404
    assert len(objects.job(job_id)) == 2
    r = client.delete(f"/v1/jobs/{job_id}", headers=h)
    assert r.status_code == 200 and r.json()["expired_reason"] == "deleted" and r.json()["expired_at"]
    assert objects.job(job_id) == []
    gone = client.get(f"/v1/jobs/{job_id}/artifacts/report.json", headers=h)
    assert gone.status_code == 410 and gone.json()["error"] == "gone" and "deleted" in gone.json()["detail"]
    assert client.get(f"/v1/jobs/{job_id}/layouts", headers=h).status_code == 200  # the layouts stay
    assert client.get("/v1/scores", params={"model": "del-model", "devices": 2}, headers=h).status_code == 200
    assert client.delete(f"/v1/jobs/{job_id}", headers=h).status_code == 200  # again: the same answer


def test_the_retention_sweep_expires_old_finished_jobs_only(world):
    settings, client, keys, objects = world
    db = database(settings.database_url)
    old, _ = seed_finished_job(settings, model_id="old-model", owner="team-a")
    new, _ = seed_finished_job(settings, model_id="new-model", owner="team-a")
    with db.transaction() as session:
        session.get(Job, old).finished_at -= timedelta(days=3)
    storage = Storage.from_settings(settings)
    assert expire_finished(db, storage, days=0) == []  # 0 keeps everything
    swept = expire_finished(db, storage, days=2)
    assert old in swept and new not in swept
    assert objects.job(old) == [] and len(objects.job(new)) == 2
    h = as_(keys, "alice")
    job = client.get(f"/v1/jobs/{old}", headers=h).json()
    assert job["expired_reason"] == "retention" and job["summary"]["layouts"]["optimised"] == 3.5
    r = client.get(f"/v1/jobs/{old}/artifacts/shards/blob.bin", headers=h)
    assert r.status_code == 410 and "retention" in r.json()["detail"]
    assert client.get(f"/v1/jobs/{new}/artifacts/shards/blob.bin", headers=h).status_code == 200
    assert expire_finished(db, storage, days=2) == []  # once
