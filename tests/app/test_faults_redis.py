"""Redis (the broker) stopped, then frozen, while a worker runs a job: submissions answer 503 JSON with
Retry-After within seconds and leave no job row; /readyz names the broker; when Redis is back the job
that was running finishes, new submissions run, nothing is lost.

A private redis-server on a free port (tests/fault_kit.py), never the shared one; the database is a
fresh one on the shared PostgreSQL. Timings are printed (`pytest -s`) for docs/reliability.md.
"""

from __future__ import annotations

import shutil
import time

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.db import Job, database
from app.main import create_app
from tests.conftest import server_unavailable
from tests.fault_kit import PrivateRedis
from tests.service_kit import WorkerProcess, spec, wait_for, worker_settings

pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker]
SUBMIT_BOUND_S = 6.0  # "within ~5 s": connect/publish timeouts of 2 s, one retry


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        server_unavailable("redis-server", "not on PATH")
    server = PrivateRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def _rows(settings) -> int:
    with database(settings.database_url).session() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def _refused_submission(client, settings, body, what: str) -> float:
    before = _rows(settings)
    t0 = time.monotonic()
    r = client.post("/v1/jobs", json=body)
    elapsed = time.monotonic() - t0
    assert r.status_code == 503, (what, r.status_code, r.text)
    assert r.headers["content-type"] == "application/json" and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"] == "broker_unavailable" and "127.0.0.1" not in r.text, r.text
    assert elapsed < SUBMIT_BOUND_S, (what, elapsed)
    assert _rows(settings) == before, "a refused submission left a job row"
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["database"] == "ok", ready.text
    assert ready.json()["checks"]["broker"].startswith("error"), ready.text
    return elapsed


def test_redis_stopped_and_frozen_then_back(tmp_path, postgres_server, redis_server):
    settings = worker_settings(tmp_path, postgres_server, (redis_server.url, "dtp-fault:"), "redisfault",
                               lease_s=5.0, stage_delay_s=0.15)
    worker = WorkerProcess(settings, tmp_path / "worker.log", name="redisfault").start()
    body = spec(calibration={"sequences": 16, "seq_len": 32}, batch_size=1, random_layouts=1, ablations=False)
    try:
        with TestClient(create_app(settings)) as client:
            running = client.post("/v1/jobs", json=body)
            assert running.status_code == 202, running.text
            first = running.json()["id"]
            wait_for(client, first, until=lambda j: j["status"] != "queued", timeout=60, worker=worker)

            redis_server.stop()  # down: connections refused
            down_s = _refused_submission(client, settings, body, "stopped")
            assert client.get("/v1/jobs").status_code == 200  # reads do not need the broker
            redis_server.start()
            redis_server.freeze()  # hung: accepts connections, never answers
            frozen_s = _refused_submission(client, settings, body, "frozen")
            t_back = time.monotonic()
            redis_server.thaw()

            r = client.post("/v1/jobs", json=body)
            assert r.status_code == 202, r.text
            accepted_s = time.monotonic() - t_back
            second = r.json()["id"]
            done_first = wait_for(client, first, timeout=90, worker=worker)
            done_second = wait_for(client, second, timeout=90, worker=worker)
            recovered_s = time.monotonic() - t_back
            assert done_first["status"] == "succeeded", done_first
            assert done_second["status"] == "succeeded", done_second
            assert client.get("/readyz").status_code == 200
            assert _rows(settings) == 2  # the running job and the one submitted after: nothing lost, no extra
            print(f"\nFAULT redis: 503 in {down_s:.2f}s (stopped), {frozen_s:.2f}s (frozen); accepted "
                  f"{accepted_s:.2f}s after it was back; both jobs succeeded {recovered_s:.1f}s after")
    finally:
        worker.stop()
