"""An API whose S3 store does not answer: a download is 503 `store_unavailable` with Retry-After (not
`artifact_damaged`: nothing says the object is damaged), never a 500, and says no endpoint."""

from __future__ import annotations

from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.migrate import upgrade
from tests.service_kit import free_port, make_settings, seed_finished_job


def test_an_unreachable_store_is_503_with_retry_after(tmp_path, monkeypatch):
    settings = make_settings(tmp_path / "var")
    settings.var_dir.mkdir(parents=True)
    upgrade(settings.database_url)
    job_id, _ = seed_finished_job(settings, model_id="tiny")  # rows (their files go to the unused root)
    dead = f"http://127.0.0.1:{free_port()}"
    for name, value in {"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x",
                        "AWS_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(name, value)
    s3 = make_settings(tmp_path / "var", storage_url="s3://bucket/prefix")
    with TestClient(create_app(s3)) as client:
        r = client.get(f"/v1/jobs/{job_id}/artifacts/shards/blob.bin")
    assert r.status_code == 503 and r.json()["error"] == "store_unavailable", r.text
    assert r.headers["retry-after"] == "10" and dead not in r.text and "shards/blob.bin" in r.json()["detail"]
