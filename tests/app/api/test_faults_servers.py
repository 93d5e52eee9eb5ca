"""The broker and the database stopped (and the broker frozen) under a running service, then restarted.

- Redis down or hung: submissions answer 503 JSON with Retry-After within seconds and leave no job row;
  /readyz names the broker; reads still work; when Redis is back the job that was running finishes,
  new submissions run, nothing is lost and nothing runs twice.
- PostgreSQL down: every /v1 endpoint and /readyz answer 503 JSON (never a plain-text 500), /healthz
  and /metrics stay up; when the database is back the API answers at once and the job that was running
  finishes (resumed after its last recorded stage, or retried), exactly once.

Both servers are private to this module (tests/fault_kit.py: a redis-server and an initdb cluster on
free ports), never the shared ones; one real Celery worker serves both tests. Timings are printed
(`pytest -s`) for docs/reliability.md.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from app.api.main import create_app
from app.api.readiness import CACHE_S as READYZ_CACHE_S
from app.core.db import Job, database
from app.core.migrate import upgrade
from tests.conftest import server_unavailable
from tests.fault_kit import PrivatePostgres, PrivateRedis, forget_database
from tests.faults import Faults
from tests.service_kit import (
    WorkerProcess,
    job_history,
    make_settings,
    provision,
    seed_finished_job,
    spec,
    wait_for,
)

# serial: it stops and freezes private servers and bounds the submit's time (SUBMIT_BOUND_S)
pytestmark = [pytest.mark.postgres, pytest.mark.redis, pytest.mark.worker, pytest.mark.serial]
SUBMIT_BOUND_S = 6.0  # "within ~5 s": publish connect/socket timeouts of 2 s, one retry
LEASE_S = 3.0
OUTAGE_S = 8.0  # the database outage: longer than the lease, which expires while it is away
BODY = spec(calibration={"sequences": 16, "seq_len": 32}, batch_size=1, random_layouts=1, ablations=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(settings, redis, postgres, worker): private servers, a migrated database, a worker on them."""
    if shutil.which("redis-server") is None:
        server_unavailable("redis-server", "not on PATH")
    reason = PrivatePostgres.unavailable()
    if reason:
        server_unavailable("a private PostgreSQL", reason)
    root = tmp_path_factory.mktemp("faults")
    postgres = PrivatePostgres()
    redis = None
    worker = None
    try:
        try:
            postgres.init()
        except Exception as exc:
            server_unavailable("a private PostgreSQL", f"{type(exc).__name__}: {exc}")
        redis = PrivateRedis(root / "redis").start()
        url = postgres.create_database("dtp_faults")
        upgrade(url)
        settings = make_settings(root, database_url=url, broker_url=redis.url, device="cpu", lease_s=LEASE_S)
        provision(settings)
        worker = WorkerProcess(settings, root / "worker.log", name="faults",
                               faults=Faults(stage_delay_s=0.15)).start()
        yield settings, redis, postgres, worker
    finally:
        if worker is not None:
            worker.stop()
        if redis is not None:
            redis.stop()
        forget_database(postgres.admin_url)
        for url in [u for u in list(_engines()) if f":{postgres.port}/" in u]:
            forget_database(url)
        postgres.destroy()


def _engines() -> Any:
    from app.core import db as app_db
    return app_db._databases


def _rows(settings) -> int:
    with database(settings.database_url).session() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def _history(settings, job_id: str) -> list[dict[str, Any]]:
    return job_history(settings, job_id)


def _refused_submission(client, settings, what: str) -> float:
    before = _rows(settings)
    t0 = time.monotonic()
    r = client.post("/v1/jobs", json=BODY)
    elapsed = time.monotonic() - t0
    assert r.status_code == 503, (what, r.status_code, r.text)
    assert r.headers["content-type"] == "application/json" and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"] == "broker_unavailable" and "127.0.0.1" not in r.text, r.text
    assert elapsed < SUBMIT_BOUND_S, (what, elapsed)
    assert _rows(settings) == before, "a refused submission left a job row"
    t0 = time.monotonic()
    ready = client.get("/readyz")
    ready_s = time.monotonic() - t0
    assert ready.status_code == 503 and ready.json()["checks"]["database"] == "ok", ready.text
    assert ready.json()["checks"]["broker"].startswith("error"), ready.text
    assert ready_s < SUBMIT_BOUND_S, (what, ready_s)
    return elapsed, ready_s


def test_redis_stopped_and_frozen_then_back(stack):
    settings, redis, _postgres, worker = stack
    try:
        with TestClient(create_app(settings)) as client:
            before = _rows(settings)
            running = client.post("/v1/jobs", json=BODY)
            assert running.status_code == 202, running.text
            first = running.json()["id"]
            wait_for(client, first, until=lambda j: j["status"] != "queued", timeout=90, worker=worker)

            redis.stop()  # down: connections refused
            down_s, down_ready_s = _refused_submission(client, settings, "stopped")
            assert client.get("/v1/jobs").status_code == 200  # reads do not need the broker
            redis.start()
            redis.freeze()  # hung: accepts connections, never answers
            frozen_s, frozen_ready_s = _refused_submission(client, settings, "frozen")
            t_back = time.monotonic()
            redis.thaw()

            r = client.post("/v1/jobs", json=BODY)
            assert r.status_code == 202, r.text
            accepted_s = time.monotonic() - t_back
            second = r.json()["id"]
            done_first = wait_for(client, first, timeout=90, worker=worker)
            done_second = wait_for(client, second, timeout=90, worker=worker)
            recovered_s = time.monotonic() - t_back
            assert done_first["status"] == "succeeded", done_first
            assert done_second["status"] == "succeeded", done_second
            time.sleep(READYZ_CACHE_S)  # /readyz answers from a cache at most this old: the frozen probe's 503
            assert client.get("/readyz").status_code == 200
            assert _rows(settings) == before + 2  # the running job and the one after: nothing lost, no extra
        for job_id in (first, second):
            assert Counter(e["event"] for e in _history(settings, job_id))["succeeded"] == 1
        print(f"\nFAULT redis: 503 in {down_s:.2f}s (stopped), {frozen_s:.2f}s (frozen); /readyz 503 in "
              f"{down_ready_s:.2f}s / {frozen_ready_s:.2f}s; accepted "
              f"{accepted_s:.2f}s after it was back; both jobs succeeded {recovered_s:.1f}s after")
    finally:
        redis.thaw()
        if redis.proc is not None and redis.proc.poll() is not None:
            redis.start()


def _endpoints(job_id: str) -> list[tuple[str, str]]:
    base = f"/v1/jobs/{job_id}"
    return [("GET", "/v1/jobs"), ("GET", base), ("GET", f"{base}/layouts"), ("GET", f"{base}/layouts/optimised"),
            ("GET", f"{base}/artifacts"), ("GET", f"{base}/artifacts/report.json"), ("GET", f"{base}/metrics"),
            ("GET", "/v1/scores"), ("POST", f"{base}/cancel"), ("POST", "/v1/jobs"), ("GET", "/readyz")]


def test_postgres_down_every_endpoint_503_then_job_finishes(stack):
    settings, _redis, postgres, worker = stack
    seeded, _ = seed_finished_job(settings, model_id="tiny")
    body = {**BODY, "calibration": {**BODY["calibration"], "seed": 7}}  # its own fingerprint: affinity not cached
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            job_id = client.post("/v1/jobs", json=body).json()["id"]
            wait_for(client, job_id, timeout=90, worker=worker,
                     until=lambda j: (j["stage"] == "affinity" and j["progress"] > 0)
                     or j["status"] not in ("queued", "running"))

            t_stop = time.monotonic()
            postgres.stop()
            slowest = 0.0
            for method, path in _endpoints(seeded):
                t0 = time.monotonic()
                r = client.request(method, path, json=BODY if path == "/v1/jobs" else None)
                slowest = max(slowest, time.monotonic() - t0)
                assert r.status_code == 503, (method, path, r.status_code, r.text)
                assert r.headers["content-type"] == "application/json", (method, path, r.text)
                doc = r.json()
                if path == "/readyz":
                    assert doc["checks"]["database"].startswith("error") and doc["checks"]["broker"] == "ok", doc
                else:
                    assert doc["error"] == "database_unavailable", (path, doc)
                    assert int(r.headers["retry-after"]) >= 1 and "127.0.0.1" not in r.text, (path, r.text)
            assert client.get("/healthz").status_code == 200  # the process is alive: no restart wanted
            assert client.get("/metrics").status_code == 200  # scraped, without the job gauges

            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t_stop)))
            t_back = time.monotonic()
            postgres.start()
            r = client.get(f"/v1/jobs/{job_id}")
            api_back_s = time.monotonic() - t_back
            assert r.status_code == 200, r.text
            done = wait_for(client, job_id, timeout=120, worker=worker)
            job_back_s = time.monotonic() - t_back
            assert done["status"] == "succeeded", done
            assert client.get("/readyz").status_code == 200
        counts = Counter(e["event"] for e in _history(settings, job_id))
        assert counts["succeeded"] == 1 and counts["failed"] == 0, counts
        print(f"\nFAULT postgres: every endpoint 503 (slowest {slowest:.2f}s) during a {OUTAGE_S:.0f}s outage; the "
              f"API answered {api_back_s:.2f}s after the restart, the job succeeded {job_back_s:.1f}s after "
              f"(attempts {done['attempts']}, requeued {counts['requeued']}x)")
    finally:
        if not (postgres.data / "postmaster.pid").exists():
            postgres.start()
