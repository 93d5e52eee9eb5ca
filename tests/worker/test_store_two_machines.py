"""The service across machines: the API (`dtp-layout serve --no-worker`) and a worker as separate processes,
each with its own, empty storage root, sharing only Postgres, Redis and an S3 store (a real S3 API server
in this process: moto's ThreadedMotoServer, spoken to over HTTP by boto3).

Every digest below is computed here with hashlib over the bytes received, and compared with the sha256 the
API lists; the bucket is listed with a boto3 client of the test's own, not through the code under test."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import httpx
import pytest

from app.client.http import LayoutClient
from tests.faults import Faults
from tests.service_kit import ServeProcess, WorkerProcess, spec, wait_for, worker_settings

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]


def api_env(settings, s3_env: dict[str, str], **more: str) -> dict[str, str]:
    """The API's settings: the worker's database, broker and model/data roots (the models a job may
    name), the store; its own var dir (so its own, empty storage root)."""
    return {"DTP_LAYOUT_DATABASE_URL": settings.database_url, "DTP_LAYOUT_BROKER_URL": settings.broker_url,
            "DTP_LAYOUT_BROKER_KEY_PREFIX": settings.broker_key_prefix,
            "DTP_LAYOUT_MODEL_ROOT": str(settings.models_dir), "DTP_LAYOUT_DATA_ROOT": str(settings.data_dir),
            **s3_env, **more}


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


def download_all(url: str, job_id: str, items: list[dict], out: Path) -> None:
    """Every artifact through the client (which follows a redirect to the store), then hashed here."""
    with LayoutClient(url) as client:
        client.download(job_id, out)
    for art in items:
        data = (out / art["name"]).read_bytes()
        assert len(data) == art["size"] and hashlib.sha256(data).hexdigest() == art["sha256"], art["name"]


def hub_snapshot(cache: Path, repo: str) -> None:
    """The tiny model as an offline Hugging Face cache's snapshot of `repo` (what a hub download leaves)."""
    from tests.tiny import tiny_model

    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / ("0" * 40)
    tiny_model("llama").save_pretrained(snapshot)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(snapshot.name)


def test_api_and_worker_share_only_database_broker_and_store(tmp_path, postgres_server, redis_broker, s3_server,
                                                             s3_bucket):
    """… and the worker has no model root at all: its model comes from the hub (an offline cache here)."""
    settings = worker_settings(tmp_path / "worker", postgres_server, redis_broker, "two_machines")
    hub_snapshot(tmp_path / "hf", "acme/tiny")
    hub = {"HF_HUB_CACHE": str(tmp_path / "hf")}  # offline: both process kits set HF_HUB_OFFLINE=1
    s3_env = s3_server.env(s3_bucket)
    no_models = settings.model_copy(update={"model_root": tmp_path / "worker" / "absent"})
    worker = WorkerProcess(no_models, tmp_path / "worker.log", **s3_env, **hub).start(timeout=120)
    api = ServeProcess(tmp_path / "api", no_worker=True, **api_env(settings, s3_env, **hub))
    second = None
    try:
        api.start()  # inside the try: an API that does not come up still stops the worker
        http = httpx.Client(base_url=api.url, timeout=30)
        job_id = http.post("/v1/jobs", json=spec(model={"id": "acme/tiny"})).json()["id"]
        job = wait_for(http, job_id, timeout=240, worker=worker)
        assert job["status"] == "succeeded", (job, worker.log()[-3000:])
        items = http.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]
        names = {a["name"] for a in items}
        assert {"report.json", "affinity.safetensors", "shards/manifest.json"} <= names and len(items) >= 6
        assert not (tmp_path / "worker" / "absent").exists()

        # the objects are in the bucket, under the job's keys; neither machine's disk holds an artifact
        keys = s3_server.keys(s3_bucket)
        assert {f"dtp/jobs/{job_id}/artifacts/{n}" for n in names} <= set(keys)
        assert any(k.startswith("dtp/affinity/") for k in keys)
        assert files_under(tmp_path / "api" / "storage") == []
        assert not [f for f in files_under(settings.storage / "jobs") if "/artifacts" in f]

        download_all(api.url, job_id, items, tmp_path / "dl-1")
        blob = next(a for a in items if a["name"].startswith("shards/") and a["size"] > 64)
        path = f"/v1/jobs/{job_id}/artifacts/{blob['name']}"
        whole = (tmp_path / "dl-1" / blob["name"]).read_bytes()
        part = http.get(path, headers={"Range": "bytes=3-40"})
        assert part.status_code == 206 and part.content == whole[3:41]
        assert part.headers["content-range"] == f"bytes 3-40/{blob['size']}"
        assert http.get(path, headers={"If-None-Match": part.headers["etag"]}).status_code == 304

        # the API restarted on a fresh, empty disk, redirecting downloads to presigned URLs
        api.stop()
        second = ServeProcess(tmp_path / "api-2", no_worker=True, **api_env(
            settings, s3_env, DTP_LAYOUT_STORAGE_REDIRECT="true", DTP_LAYOUT_PRESIGN_EXPIRY_S="120", **hub)).start()
        http = httpx.Client(base_url=second.url, timeout=30)
        moved = http.get(path)
        assert moved.status_code == 307 and moved.headers["etag"] == f'"{blob["sha256"]}"'
        location = urlparse(moved.headers["location"])
        query = {k: v[0] for k, v in parse_qs(location.query).items()}
        # moto accepts tampered signatures: the URL is checked by what it says, not by moto's answer
        assert f"{location.scheme}://{location.netloc}" == s3_server.endpoint
        assert location.path == f"/{s3_bucket}/dtp/jobs/{job_id}/artifacts/{blob['name']}"
        assert query["X-Amz-Expires"] == "120" and query["X-Amz-Algorithm"] == "AWS4-HMAC-SHA256"
        assert len(query["X-Amz-Signature"]) == 64 and query["X-Amz-Credential"].startswith("testing/")
        assert query["X-Amz-SignedHeaders"] == "host"
        assert "attachment" in query["response-content-disposition"]
        assert httpx.get(moved.headers["location"]).content == whole  # the URL fetches the object, no key
        as_json = http.get(path, headers={"X-Store-Redirect": "json"})  # the dashboard's ask
        assert as_json.status_code == 200 and as_json.headers["x-store-redirect"] == "json"
        assert urlparse(as_json.json()["location"]).path == location.path and as_json.json()["expires_s"] == 120
        ranged = httpx.get(moved.headers["location"], headers={"Range": "bytes=5-9"})  # a resumed client's ask
        assert ranged.status_code == 206 and ranged.content == whole[5:10]
        download_all(second.url, job_id, items, tmp_path / "dl-2")  # the client follows the redirects
        assert files_under(tmp_path / "api-2" / "storage") == []

        # an object replaced in the store (same size, other bytes) is refused, redirect or not
        s3_server.client().put_object(Bucket=s3_bucket, Key=f"dtp/jobs/{job_id}/artifacts/{blob['name']}",
                                      Body=bytes(b ^ 1 for b in whole))
        damaged = http.get(path)
        assert damaged.status_code == 503 and damaged.json()["error"] == "artifact_damaged", damaged.text
        s3_server.client().delete_object(Bucket=s3_bucket, Key=f"dtp/jobs/{job_id}/artifacts/{blob['name']}")
        assert http.get(path).status_code == 404
    finally:
        api.stop()
        if second is not None:
            second.stop()
        worker.stop()


def test_a_worker_killed_mid_upload_leaves_no_artifact_and_the_sweep_aborts_its_upload(
        tmp_path, postgres_server, redis_broker, s3_server, s3_bucket):
    from app.core.db import database
    from worker.sweeps.store import sweep_store

    settings = worker_settings(tmp_path / "worker", postgres_server, redis_broker, "killed_upload")
    s3_env = s3_server.env(s3_bucket)
    worker = WorkerProcess(settings, tmp_path / "worker.log", faults=Faults(hang_store_upload=True),
                           **s3_env).start(timeout=120)
    store = s3_server.store(s3_bucket)
    try:
        http_app = ServeProcess(tmp_path / "api", no_worker=True, **api_env(settings, s3_env))
        try:
            http_app.start()
            http = httpx.Client(base_url=http_app.url, timeout=30)
            job_id = http.post("/v1/jobs", json=spec(export={"checkpoint": False, "shards": False})).json()["id"]
            deadline = time.monotonic() + 180
            while not store.list_multipart("") and time.monotonic() < deadline:  # its first upload began
                assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
                time.sleep(0.2)
            assert store.list_multipart(""), worker.log()[-3000:]
            worker.kill9()
            assert http.get(f"/v1/jobs/{job_id}/artifacts").json()["items"] == []
            assert http.get(f"/v1/jobs/{job_id}").json()["status"] == "running"
        finally:
            http_app.stop()
        swept = sweep_store(database(settings.database_url), store, stale_s=0)
        assert swept.aborted >= 1 and store.list_multipart("") == []
        assert not [k for k in s3_server.keys(s3_bucket) if k.startswith(f"dtp/jobs/{job_id}/")]
    finally:
        worker.stop()
