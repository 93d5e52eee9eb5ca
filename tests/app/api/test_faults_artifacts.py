"""An artifact damaged on disk after its job published it is never served as valid.

The size is checked on every download (one fstat); the sha256 when the file changed since it last
verified (its inode, size, mtime or ctime): an untouched file is hashed once per API process, not per
request. A truncated, altered (even with its mtime put back) or swapped file is refused with a 503
`artifact_damaged` naming the artifact (no server path), counted in /metrics by reason; restored, it
is served again.
"""

from __future__ import annotations

import os

import pytest
from fastapi.testclient import TestClient

import app.core.storage.root as storage_module
from app.api.main import create_app
from app.core.migrate import upgrade
from app.core.storage.root import Storage
from tests.service_kit import make_settings, seed_finished_job


@pytest.fixture
def served(tmp_path, monkeypatch):
    settings = make_settings(tmp_path / "var")
    settings.var_dir.mkdir(parents=True)
    upgrade(settings.database_url)
    job_id, payload = seed_finished_job(settings, model_id="tiny")
    hashed: list[int] = []
    real = storage_module._sha256

    def counting(f):
        hashed.append(1)
        return real(f)

    monkeypatch.setattr(storage_module, "_sha256", counting)
    path = Storage(settings.storage).path(Storage.artifact_key(job_id, "shards/blob.bin"))
    with TestClient(create_app(settings)) as client:
        yield client, f"/v1/jobs/{job_id}/artifacts/shards/blob.bin", path, payload, hashed, str(settings.var_dir)


def _damaged(client, url: str, var_dir: str) -> dict:
    for method, headers in (("GET", {}), ("GET", {"Range": "bytes=0-99"}), ("HEAD", {})):
        r = client.request(method, url, headers=headers)
        assert r.status_code == 503, (method, headers, r.status_code)
        if method == "GET":
            doc = r.json()
            assert doc["error"] == "artifact_damaged" and doc["field"] == "name", doc
            assert "shards/blob.bin" in doc["detail"] and var_dir not in r.text and "/tmp" not in r.text, doc
            assert "retry-after" not in r.headers  # waiting does not mend it
    return doc


def _counted(client, reason: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'dtp_layout_artifacts_damaged_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_damaged_artifacts_are_refused_and_counted(served):
    client, url, path, payload, hashed, var_dir = served
    for _ in range(3):
        r = client.get(url)
        assert r.status_code == 200 and r.content == payload
    assert client.get(url, headers={"Range": "bytes=10-19"}).content == payload[10:20]
    assert len(hashed) == 1, "an unchanged file is hashed once, not per download"

    path.write_bytes(payload[:4000])  # truncated
    assert "size" in _damaged(client, url, var_dir)["detail"]
    assert _counted(client, "size") == 3
    assert len(hashed) == 1, "a size mismatch needs no hashing"

    altered = bytearray(payload)
    altered[2500] ^= 0xFF
    st = os.stat(path)
    path.write_bytes(bytes(altered))  # same size, one byte flipped, the mtime put back
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert "sha256" in _damaged(client, url, var_dir)["detail"]
    assert _counted(client, "sha256") == 3

    path.write_bytes(payload)  # restored by the operator: verified again, then served
    assert client.get(url).content == payload
    hashes = len(hashed)
    assert client.get(url).content == payload and len(hashed) == hashes

    swapped = path.with_name("swap.tmp")
    swapped.write_bytes(bytes(altered))
    os.utime(swapped, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns))
    os.replace(swapped, path)  # another file renamed over it, same size and mtime: a new inode
    _damaged(client, url, var_dir)
    assert _counted(client, "sha256") == 6

    path.unlink()
    r = client.get(url)
    assert r.status_code == 404 and r.json()["field"] == "name" and var_dir not in r.text
    assert _counted(client, "missing") == 1
    assert client.get("/healthz").status_code == 200
