"""The embedded default (SQLite, WAL): a worker holding the write lock never delays a read.

Another process takes the database's write lock (BEGIN IMMEDIATE, as a worker's transaction does) and
holds it; meanwhile every read endpoint answers promptly. Reads begin deferred and, under WAL, read the
last committed state without waiting (before this, every transaction began IMMEDIATE: a GET queued
behind the worker for up to the 30 s busy timeout). A write (cancel) waits for the lock and then
succeeds once it is released.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from fastapi.testclient import TestClient

from app.api.main import create_app
from app.core.db import Job, database
from app.core.migrate import upgrade
from tests.service_kit import make_settings, seed_finished_job, spec

READ_BOUND_S = 1.0
HOLDER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE jobs SET updated_at = updated_at")  # a write: the lock is taken and held
print("locked", flush=True)
sys.stdin.readline()
conn.execute("COMMIT")
print("released", flush=True)
"""


@pytest.fixture
def service(tmp_path):
    settings = make_settings(tmp_path / "var")
    settings.var_dir.mkdir(parents=True)
    upgrade(settings.database_url)
    job_id, _ = seed_finished_job(settings, model_id="tiny")
    with database(settings.database_url).transaction() as session:  # a queued job: the cancel below writes it
        queued = Job(spec=spec(), fingerprint="e" * 64, model_id="tiny", devices=2, schedule="dtp:1", score="fo",
                     status="queued", progress=0.0, stages_done=[], timings={}, cancel_requested=False,
                     affinity_cached=False, attempts=0)
        session.add(queued)
    with TestClient(create_app(settings)) as client:
        yield settings, client, job_id, queued.id


@pytest.mark.serial  # a latency bound (READ_BOUND_S)
def test_reads_never_wait_behind_a_writer(service):
    settings, client, job_id, queued = service
    db_file = settings.database_url.removeprefix("sqlite:///")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, db_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "locked"
        base = f"/v1/jobs/{job_id}"
        timings = {}
        for path in ("/v1/jobs", base, f"{base}/layouts", f"{base}/layouts/optimised", f"{base}/artifacts",
                     f"{base}/artifacts/shards/blob.bin", f"{base}/metrics", "/v1/scores?model=tiny", "/readyz",
                     "/metrics"):
            t0 = time.monotonic()
            r = client.get(path)
            timings[path] = time.monotonic() - t0
            assert r.status_code == 200, (path, r.status_code, r.text)
        slowest = max(timings.values())
        assert slowest < READ_BOUND_S, timings

        # A write waits for the lock (it is not refused), and goes through once the worker commits.
        result: dict[str, object] = {}

        def cancel() -> None:
            t0 = time.monotonic()
            result["status"] = client.post(f"/v1/jobs/{queued}/cancel").status_code
            result["seconds"] = time.monotonic() - t0

        writer = threading.Thread(target=cancel)
        writer.start()
        time.sleep(0.5)
        assert writer.is_alive(), f"the write did not wait for the lock: {result}"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        writer.join(timeout=30)
        assert result["status"] == 202, result
        assert client.get(f"/v1/jobs/{queued}").json()["status"] == "cancelled"
        print(f"\nFAULT sqlite: with the write lock held elsewhere, the slowest of {len(timings)} reads took "
              f"{slowest * 1000:.0f} ms; a cancel waited {float(result['seconds']):.2f}s for the lock, then succeeded")
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait(timeout=10)
