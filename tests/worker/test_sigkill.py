"""A worker killed with SIGKILL in the middle of a job: a new worker resumes it after its last finished
stage, and the job finishes once, with one set of artifacts (rows and files)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from app.api.main import create_app
from app.core.db import Artifact, LayoutRow, database
from app.core.storage.root import Storage, sha256_file
from tests.faults import Faults
from tests.service_kit import WorkerProcess, spec, wait_for, worker_settings

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]


@pytest.fixture
def settings(tmp_path, postgres_server, redis_broker):
    # A short lease so that the dead worker's job is re-enqueued within seconds (the sweeper's `requeued`).
    # The dead worker's own message comes back only after the visibility timeout (default 2 × LEASE_S, at
    # least 10 s): on a loaded machine the kill and the second worker's start took longer than that, the
    # second worker got the old message back before its sweeper ran and claimed the job with no `requeued`
    # event. Far past the test's end, it cannot race the sweep this test checks.
    return worker_settings(tmp_path, postgres_server, redis_broker, "kill", lease_s=2.0, visibility_timeout_s=600)


# A stage delay (tests/faults.py) so that the affinity stage is reliably in progress when the worker is killed.
SLOW = Faults(stage_delay_s=0.3)


def test_sigkill_mid_affinity_then_resume_once(settings):
    log = settings.var_dir / "workers.log"
    first = WorkerProcess(settings, log, name="first", faults=SLOW).start()
    second = None
    try:
        with TestClient(create_app(settings)) as client:
            body = spec(calibration={"sequences": 24, "seq_len": 32}, batch_size=1, random_layouts=1,
                        ablations=False)
            job_id = client.post("/v1/jobs", json=body).json()["id"]
            mid = wait_for(client, job_id, timeout=60, worker=first,
                           until=lambda j: (j["stage"] == "affinity" and j["progress"] >= 0.2)
                           or j["status"] not in ("queued", "running"))
            assert mid["status"] == "running" and mid["stages_done"] == ["loading", "calibration"], mid
            first.kill9()

            second = WorkerProcess(settings, log, name="second", faults=SLOW).start()
            done = wait_for(client, job_id, timeout=90, worker=second)
            assert done["status"] == "succeeded", done
            time.sleep(2.5)  # nothing runs it again
            after = client.get(f"/v1/jobs/{job_id}").json()
            assert after["status"] == "succeeded" and after["updated_at"] == done["updated_at"]

        assert done["attempts"] == 2
        history = [e["event"] + ":" + str(e.get("stage", "")) for e in _history(settings, job_id)]
        counts = Counter(history)
        assert counts["claimed:"] == 2 and counts["requeued:"] == 1 and counts["succeeded:"] == 1
        assert counts["stage-done:calibration"] == 1 and counts["stage-start:calibration"] == 1  # resumed after it
        assert counts["stage-start:affinity"] == 2 and counts["stage-done:affinity"] == 1
        assert counts["stage-done:exporting"] == 1

        db = database(settings.database_url)
        with db.session() as session:
            rows = session.scalars(select(Artifact).where(Artifact.job_id == job_id)).all()
            layouts = session.scalars(select(LayoutRow.name).where(LayoutRow.job_id == job_id)).all()
        names = [r.name for r in rows]
        assert len(names) == len(set(names)) and "report.json" in names and "shards/manifest.json" in names
        assert sorted(layouts) == ["contiguous", "optimised", "random-1000"]
        storage = Storage(settings.storage)
        for row in rows:
            assert sha256_file(storage.path(row.storage_key)) == row.sha256
        # the second attempt published under its own keys (Storage.artifact_key), the job's affinity included
        artifact_dir = storage.job_dir(job_id) / "artifacts-2"
        on_disk = sorted(str(p.relative_to(artifact_dir)) for p in artifact_dir.rglob("*") if p.is_file())
        assert on_disk == sorted(names) and not (storage.job_dir(job_id) / "artifacts").exists()
        assert len(list((settings.storage / "affinity").rglob("affinity.safetensors"))) == 1
    finally:
        first.stop()
        if second is not None:
            second.stop()


def _history(settings, job_id):
    from tests.service_kit import job_history

    return job_history(settings, job_id)
