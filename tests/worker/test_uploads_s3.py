"""A tenant's own model and data through the S3 store, on two "machines": the API (in this process) and a
real Celery worker (a subprocess) share only Postgres, Redis and a bucket on moto's ThreadedMotoServer;
each has its own empty storage root and no model or data root content. The tenant uploads the tiny
model as a Hugging Face directory and token ids, runs a job naming both, downloads every artifact
through the API (sha256 checked); deleting the job and the uploads removes their objects (the bucket
listed with boto3)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.migrate import upgrade
from tests.app.api.test_uploads import model_files, npy_bytes, upload
from tests.service_kit import WorkerProcess, make_settings, spec, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.postgres, pytest.mark.redis]


def test_a_job_on_uploaded_model_and_data_across_machines_with_the_s3_store(tmp_path, postgres_server, redis_broker,
                                                                           s3_server, s3_bucket, monkeypatch):
    from tests.tiny import tiny_model

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)  # this process's boto3, and the worker's
    url = postgres_server.create_database("dtp_uploads_s3")
    upgrade(url)
    broker, prefix = redis_broker
    shared = {"database_url": url, "broker_url": broker, "broker_key_prefix": f"{prefix}uploads-s3:",
              "storage_url": f"s3://{s3_bucket}/dtp"}
    api_settings = make_settings(tmp_path / "api", **shared)
    worker_settings = make_settings(tmp_path / "worker", device="cpu", **shared)
    model_dir = tmp_path / "client" / "tiny"
    tiny_model("llama").save_pretrained(model_dir)
    files = model_files(model_dir)
    worker = WorkerProcess(worker_settings, tmp_path / "worker.log", name="uploads-s3").start()
    try:
        with TestClient(create_app(api_settings)) as client:
            model = upload(client, {}, "model", files, name="tiny")
            data = upload(client, {}, "data", {"ids.npy": npy_bytes(np.random.default_rng(2).integers(0, 97, 4096))})
            keys = s3_server.keys(s3_bucket)
            assert sum(model["id"] in k for k in keys) == len(files) and sum(data["id"] in k for k in keys) == 1
            r = client.post("/v1/jobs", json=spec(model={"id": model["ref"]}, calibration={"source": data["ref"]},
                                                  ablations=False, random_layouts=1))
            assert r.status_code == 202, r.text
            job = wait_for(client, r.json()["id"], timeout=240, worker=worker)
            assert job["status"] == "succeeded", (job["error"], worker.log()[-3000:])
            arts = client.get(f"/v1/jobs/{job['id']}/artifacts").json()["items"]
            assert {a["name"] for a in arts} >= {"report.json", "shards/manifest.json"}
            for art in arts:
                body = client.get(f"/v1/jobs/{job['id']}/artifacts/{art['name']}")
                assert body.status_code == 200 and hashlib.sha256(body.content).hexdigest() == art["sha256"]
            # the worker loaded a copy fetched from the bucket; nothing of it reached the API's disk
            cached = tmp_path / "worker" / "storage" / "cache" / "uploads" / model["id"]
            assert sorted(p.name for p in cached.iterdir()) == sorted(files)
            assert not (tmp_path / "api" / "storage" / "uploads").exists()
            assert any(f"jobs/{job['id']}/artifacts" in k for k in s3_server.keys(s3_bucket))
            assert client.delete(f"/v1/jobs/{job['id']}").status_code == 200
            assert not [k for k in s3_server.keys(s3_bucket) if f"jobs/{job['id']}/" in k]
            assert client.get(f"/v1/jobs/{job['id']}/artifacts/report.json").status_code == 410
            for up in (model, data):
                assert client.delete(f"/v1/uploads/{up['id']}").status_code == 204
            assert not [k for k in s3_server.keys(s3_bucket) if "uploads/" in k]
            pending = s3_server.client().list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
            assert pending == []
    finally:
        worker.stop()
