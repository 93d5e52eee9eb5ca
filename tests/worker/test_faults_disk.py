"""The storage volume fills up while a job exports: the job ends `failed` with "no space left", its
partial files are removed (the space comes back), and the API stays healthy.

The storage root is a real 512 KiB tmpfs: the stages before exporting fit, the checkpoint (~290 kB)
fits, the rank shards (~330 kB) do not. Mounting needs root (CAP_SYS_ADMIN); elsewhere the test is
skipped with that reason. The job runs in this process through `worker.entry.run_job`, the code a
Celery worker runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import database
from app.core.migrate import upgrade
from tests.service_kit import make_settings, provision, spec
from worker.entry import run_job

VOLUME = "512k"


@pytest.fixture
def small_volume(tmp_path):
    mount_point = tmp_path / "storage"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a size-limited tmpfs needs root (CAP_SYS_ADMIN); no honest disk-full without it")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={VOLUME},mode=0755", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:200]})")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_disk_full_while_exporting(tmp_path, small_volume):
    settings = make_settings(tmp_path / "var", storage_root=small_volume, device="cpu")
    settings.var_dir.mkdir(parents=True)
    upgrade(settings.database_url)
    provision(settings)
    body = spec(calibration={"sequences": 8, "seq_len": 32}, random_layouts=1, ablations=False,
                export={"checkpoint": True, "shards": True})
    with TestClient(create_app(settings)) as client:
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        outcome = run_job(job_id, settings=settings, db=database(settings.database_url), worker="disk-test")
        assert outcome == "failed"

        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "failed" and job["error_stage"] == "exporting", job
        assert "no space left" in job["error"] and str(small_volume) not in job["error"], job["error"]
        # Partial files removed: the attempt's work directory (the checkpoint, the partial shards) is gone,
        # no artifact of the export was published; the shared affinity cache stays for the next job.
        remaining = _files(small_volume)
        assert not any(f.startswith(f"jobs/{job_id}/work") for f in remaining), remaining
        assert not any("checkpoint/" in f or "shards/" in f for f in remaining), remaining
        names = [a["name"] for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]]
        assert not any(n.startswith(("checkpoint/", "shards/")) for n in names), names
        usage = shutil.disk_usage(small_volume)
        assert usage.used < usage.total // 4, (usage, remaining)

        # The API is healthy and takes the next job (one that fits: layouts only).
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200
        small = client.post("/v1/jobs", json={**body, "export": {"checkpoint": False, "shards": False}})
        assert small.status_code == 202, small.text
        assert run_job(small.json()["id"], settings=settings, db=database(settings.database_url),
                       worker="disk-test") == "succeeded"
        print(f"\nFAULT disk: failed in exporting with {job['error']!r}; {usage.used // 1024} KiB of "
              f"{usage.total // 1024} KiB used after the cleanup; the next job succeeded")
