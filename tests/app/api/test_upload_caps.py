"""Upload caps through the API, on SQLite and the real Postgres, with the local store and S3 (moto's
ThreadedMotoServer): files per upload, open uploads per tenant, empty files counted at the minimum,
open uploads expired by the sweep (their quota and multipart uploads released), /v1/uploads in
bounded pages (and the client following them), and concurrent `complete` calls: one completes, the
others are 409, no multipart upload is left behind."""

from __future__ import annotations

import hashlib
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Upload, database
from app.core.keys import create_key
from app.core.migrate import upgrade
from app.core.storage.root import Storage
from tests.app.api.test_uploads import PART, Objects, declare, send_all
from tests.service_kit import make_settings, provision
from worker.sweeps.owned import expire_open_uploads

BACKENDS = [pytest.param(("postgres", "local"), marks=[pytest.mark.postgres], id="postgres-local"),
            pytest.param(("sqlite", "local"), id="sqlite-local"), pytest.param(("sqlite", "s3"), id="sqlite-s3")]
MIN_FILE = 4096


@pytest.fixture(scope="module", params=BACKENDS)
def world(request, tmp_path_factory):
    database_kind, store = request.param
    root = tmp_path_factory.mktemp(f"caps-{database_kind}-{store}")
    overrides = {}
    if database_kind == "postgres":
        overrides = {"database_url": request.getfixturevalue("postgres_server").create_database("dtp_caps")}
    saved = os.environ.get("AWS_ENDPOINT_URL")
    objects = Objects(root / "storage")
    if store == "s3":
        s3 = request.getfixturevalue("s3_server")
        bucket = s3.create_bucket()
        os.environ["AWS_ENDPOINT_URL"] = s3.endpoint
        overrides["storage_url"] = f"s3://{bucket}/dtp"
        objects = Objects(root / "storage", s3, bucket)
    settings = make_settings(root, key_cache_s=0, upload_part_bytes=PART, upload_max_bytes=64 << 20,
                             upload_max_files=4, upload_max_open=3, upload_min_file_bytes=MIN_FILE,
                             api_threads=12, **overrides)
    upgrade(settings.database_url)
    provision(settings)
    db = database(settings.database_url, pool_size=12)
    try:
        with TestClient(create_app(settings)) as client:
            yield settings, client, db, objects
    finally:
        if saved is None:
            os.environ.pop("AWS_ENDPOINT_URL", None)
        else:
            os.environ["AWS_ENDPOINT_URL"] = saved


def tenant(world) -> dict[str, str]:
    """A fresh tenant's key headers (so that each test starts at zero open uploads)."""
    _settings, _client, db, _objects = world
    name = f"t{uuid.uuid4().hex[:8]}"
    return {"X-API-Key": create_key(db, name=name, tenant=name)}


def test_files_per_upload_and_open_uploads_are_capped(world):
    _settings, client, _db, _objects = world
    h = tenant(world)
    r = declare(client, h, "data", {f"{i}.txt": b"x" for i in range(5)})
    assert r.status_code == 422, r.text
    assert [(e["field"], "UPLOAD_MAX_FILES" in e["msg"]) for e in r.json()["detail"]] == [("files", True)]
    opened = [declare(client, h, "data", {"a.txt": b"a"}) for _ in range(3)]
    assert [r.status_code for r in opened] == [201] * 3
    r = declare(client, h, "data", {"a.txt": b"a"})
    assert r.status_code == 429 and r.json()["error"] == "too_many_open_uploads" and "Retry-After" in r.headers
    assert "3 open uploads" in r.json()["detail"] and "UPLOAD_MAX_OPEN=3" in r.json()["detail"]
    assert client.delete(f"/v1/uploads/{opened[0].json()['id']}", headers=h).status_code == 204
    assert declare(client, h, "data", {"a.txt": b"a"}).status_code == 201  # room again


def test_empty_files_count_the_minimum(world):
    _settings, client, _db, _objects = world
    h = tenant(world)
    r = declare(client, h, "data", {"a.txt": b"", "b.txt": b"", "c.txt": b"12345"})
    assert r.status_code == 201, r.text
    assert r.json()["size"] == 5 and r.json()["charged"] == 3 * MIN_FILE
    usage = client.get("/v1/usage", headers=h).json()
    assert usage["bytes"]["uploads_data"] == 3 * MIN_FILE == usage["used_bytes"]


def test_open_uploads_expire_and_release_their_quota_and_parts(world):
    settings, client, db, objects = world
    h = tenant(world)
    data = os.urandom(PART + 10)
    stale = declare(client, h, "data", {"big.txt": data}).json()
    r = client.put(f"/v1/uploads/{stale['id']}/files/big.txt/parts/1", content=data[:PART], headers=h)
    assert r.status_code == 204
    fresh = declare(client, h, "data", {"f.txt": b"fresh"}).json()
    assert objects.pending(stale["id"]) == 1
    with db.transaction() as session:
        session.get(Upload, stale["id"]).created_at -= timedelta(hours=2)
    swept = expire_open_uploads(db, Storage.from_settings(settings), ttl_s=3600)
    assert stale["id"] in swept and fresh["id"] not in swept
    assert client.get(f"/v1/uploads/{stale['id']}", headers=h).status_code == 404
    assert objects.pending(stale["id"]) == 0 and objects.of(stale["id"]) == {}
    assert client.get("/v1/usage", headers=h).json()["bytes"]["uploads_data"] == MIN_FILE  # the fresh one only


def test_uploads_are_listed_in_bounded_pages_and_the_client_follows_them(world):
    from app.client.http import LayoutClient

    _settings, client, _db, _objects = world
    h = tenant(world)
    ids = []
    for i in range(5):
        up = declare(client, h, "data", {"a.txt": f"{i}".encode()}, name=f"u{i}").json()
        assert client.put(f"/v1/uploads/{up['id']}/files/a.txt/parts/1", content=f"{i}".encode(),
                          headers=h).status_code == 204
        assert client.post(f"/v1/uploads/{up['id']}/complete", headers=h).status_code == 200
        ids.append(up["id"])
    first = client.get("/v1/uploads", params={"limit": 2}, headers=h).json()
    assert first["total"] == 5 and len(first["items"]) == 2 and first["next"].endswith("limit=2&offset=2")
    seen, page = [], first
    while True:
        seen += [u["id"] for u in page["items"]]
        if not page["next"]:
            break
        page = client.get(page["next"], headers=h).json()
    assert seen == ids[::-1]  # newest first, each once
    assert client.get("/v1/uploads", params={"limit": 201}, headers=h).status_code == 422
    assert client.get("/v1/uploads", headers=h).json()["limit"] == 50
    with LayoutClient("http://testserver", h["X-API-Key"], transport=ThroughTestClient(client)) as api:
        assert [u["id"] for u in api.uploads(limit=3)] == ids[::-1][:3]
        assert [u["id"] for u in api.uploads()] == ids[::-1]


class ThroughTestClient(httpx.BaseTransport):
    """The client's own requests (and its paging) answered by the test app."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        r = self.client.request(request.method, str(request.url), headers=dict(request.headers),
                                content=request.read())
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)


@pytest.mark.parametrize("callers", [4])
def test_concurrent_completes_one_completes_the_others_are_409(world, callers):
    _settings, client, _db, objects = world
    h = tenant(world)
    data = os.urandom(3 * PART + 1234)  # four parts: the assembling takes long enough for all to arrive
    up = declare(client, h, "data", {"big.txt": data}).json()
    send_all(client, h, up, {"big.txt": data})
    start = threading.Barrier(callers)

    def complete():
        start.wait()
        return client.post(f"/v1/uploads/{up['id']}/complete", headers=h)

    with ThreadPoolExecutor(callers) as pool:
        answers = list(pool.map(lambda _: complete(), range(callers)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] + [409] * (callers - 1), [(r.status_code, r.text[:200]) for r in answers]
    assert all(r.json()["error"] == "upload_completing" for r in answers if r.status_code == 409)
    assert client.get(f"/v1/uploads/{up['id']}", headers=h).json()["status"] == "complete"
    assert objects.pending(up["id"]) == 0
    assert hashlib.sha256(objects.of(up["id"])["big.txt"]).hexdigest() == hashlib.sha256(data).hexdigest()
    again = client.post(f"/v1/uploads/{up['id']}/complete", headers=h)  # later: the complete upload, as before
    assert again.status_code == 200 and again.json()["status"] == "complete"
