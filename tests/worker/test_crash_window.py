"""The crash window between a worker taking a job's message and claiming the job (issue 31).

- The task claims first: receipt → claim is one database update, ≤ 0.5 s with both cores busy.
- A worker killed inside that window (holding the message, the job unclaimed) costs a restart, not
  REQUEUE_AFTER_S: the restarted worker re-sends the jobs nobody holds that were sent before it started.
- A message for a job of another database is an error naming the job and the database, handed back a
  bounded number of times, never acknowledged silently as done.
- Two services with different databases never share the embedded broker, and `serve` refuses a broker
  that already serves another database.
"""

from __future__ import annotations

import multiprocessing
import re
import sqlite3
import time

import httpx
import pytest
from sqlalchemy import select

from app.core.broker_owner import SQLITE_TABLE, database_identity, mark_broker
from app.core.db import Job, JobEvent, database
from app.core.migrate import upgrade
from app.core.queue import enqueue, make_celery
from app.core.settings import Settings, embedded_broker_path
from tests.faults import Faults
from tests.service_kit import (
    ServeProcess,
    WorkerProcess,
    make_settings,
    provision,
    seed_job,
    spec,
    wait_for,
    worker_settings,
)

pytestmark = [pytest.mark.worker]

CLAIMED = re.compile(r"job ([0-9a-f]{32}): claimed \(attempt (\d+)\) ([0-9.]+) s after its message was received")


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _events(settings: Settings, job_id: str) -> list[JobEvent]:
    with database(settings.database_url).session() as session:
        return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)))


@pytest.mark.serial  # busy-loops both cores; latency bound (≤ 0.5 s)
def test_worker_killed_before_its_claim_costs_a_restart_not_the_requeue_period(tmp_path):
    """`serve` (SQLite, its supervised worker): the worker dies holding the job's message, before the
    claim; the supervisor restarts it and the job runs at once — with REQUEUE_AFTER_S at 600 s. Then, with
    both cores kept busy, the next job's receipt → claim is ≤ 0.5 s."""
    var = tmp_path / "var"
    settings = make_settings(var)
    provision(settings)
    marker = tmp_path / "died-before-claim"
    serve = ServeProcess(var, faults=Faults(die_before_claim=str(marker)), DTP_LAYOUT_REQUEUE_AFTER_S="600",
                         DTP_LAYOUT_LEASE_S="10")
    body = spec(random_layouts=0, ablations=False, export={"checkpoint": False, "shards": False})
    try:
        serve.start()
        with httpx.Client(base_url=serve.url, timeout=30) as client:
            t0 = time.monotonic()
            job_id = client.post("/v1/jobs", json=body).json()["id"]
            done = wait_for(client, job_id, timeout=150)
            took = time.monotonic() - t0
            assert marker.exists(), "the fault never fired: the worker was not killed before its claim"
            assert done["status"] == "succeeded", (done, serve.worker_log()[-3000:])
            assert done["attempts"] == 1  # the dead worker never claimed it
            kinds = [(e.kind, e.reason or "") for e in _events(settings, job_id)]
            assert any(kind == "requeued" and "(re)started" in reason for kind, reason in kinds), kinds
            assert took < 120, took  # restart + the worker's start + the run; the requeue period is 600 s

            # Receipt → claim with two busy-looping processes on the two cores.
            burners = [multiprocessing.Process(target=_burn, args=(60.0,), daemon=True) for _ in range(2)]
            for p in burners:
                p.start()
            try:
                second = client.post("/v1/jobs", json=body).json()["id"]
                assert wait_for(client, second, timeout=150)["status"] == "succeeded"
            finally:
                for p in burners:
                    p.terminate()
        held = {m.group(1): float(m.group(3)) for m in CLAIMED.finditer(serve.worker_log())}
        assert second in held and job_id in held, serve.worker_log()[-3000:]
        assert held[second] <= 0.5 and held[job_id] <= 0.5, held
        print(f"\nkilled before its claim -> succeeded: {took:.1f} s; receipt -> claim: {held[job_id]:.3f} s "
              f"(idle), {held[second]:.3f} s (two cores busy)")
    finally:
        serve.stop()


def test_two_services_with_different_databases_get_brokers_of_their_own(tmp_path):
    var = tmp_path / "var"
    default = Settings(var_dir=var)
    one = Settings(var_dir=var, database_url=f"sqlite:///{tmp_path / 'one' / 'jobs.db'}")
    two = Settings(var_dir=var, database_url=f"sqlite:///{tmp_path / 'two' / 'jobs.db'}")
    server = Settings(var_dir=var, database_url="postgresql+psycopg://u:secret@db.example/jobs")
    brokers = {s.broker_url for s in (default, one, two, server)}
    assert len(brokers) == 4, brokers
    assert default.broker_url.endswith(f"{var}/broker.db")  # the default deployment keeps its broker file
    assert one.broker_url == f"sqla+sqlite:///{tmp_path / 'one' / 'jobs.db.broker.db'}"
    assert "secret" not in server.broker_url and server.broker_url.startswith(f"sqla+sqlite:///{var}/broker-")
    assert embedded_broker_path(var, one.database_url) == tmp_path / "one" / "jobs.db.broker.db"


def test_serve_refuses_a_broker_that_serves_another_database(tmp_path):
    var = tmp_path / "var"
    var.mkdir()
    shared_broker = f"sqla+sqlite:///{tmp_path / 'shared-broker.db'}"
    first = Settings(var_dir=var, database_url=f"sqlite:///{tmp_path / 'first.db'}", broker_url=shared_broker)
    assert mark_broker(first) is None and mark_broker(first) is None  # marking is idempotent
    with sqlite3.connect(tmp_path / "shared-broker.db") as conn:
        owner = conn.execute(f"SELECT database FROM {SQLITE_TABLE}").fetchone()[0]
    assert owner == database_identity(first.database_url)

    serve = ServeProcess(var, no_worker=True, DTP_LAYOUT_DATABASE_URL=f"sqlite:///{tmp_path / 'second.db'}",
                         DTP_LAYOUT_BROKER_URL=shared_broker)
    with pytest.raises(RuntimeError) as refused:
        serve.start(timeout=60)
    text = refused.value.args[0]
    assert "already serves another database" in text and str(tmp_path / "first.db") in text, text
    assert serve.proc is not None and serve.proc.wait(timeout=10) == 2


@pytest.mark.postgres
@pytest.mark.redis
def test_a_message_for_another_databases_job_is_an_error_and_goes_back_boundedly(tmp_path, postgres_server,
                                                                                 redis_broker):
    """A worker of database A gets a message naming a job only database B holds (a shared Redis): it logs
    an error naming the job and its database, hands the message back FOREIGN_REDELIVERIES times, then
    drops it with an error — never the info-level "nothing to do" of a finished job."""
    from worker.tasks import FOREIGN_REDELIVERIES

    url = postgres_server.create_database("dtp_foreign")
    upgrade(url)
    broker, prefix = redis_broker
    settings = make_settings(tmp_path / "a", database_url=url, broker_url=broker, broker_key_prefix=f"{prefix}fx:",
                             device="cpu")
    provision(settings)
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        foreign = "f" * 32
        with database(url).session() as session:
            assert session.scalar(select(Job.id).where(Job.id == foreign)) is None
        enqueue(make_celery(settings, publisher=True), settings, foreign)
        deadline = time.monotonic() + 60
        while "dead-lettered" not in worker.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = worker.log()
        assert f"job {foreign}: no such job in this worker's database" in log, log[-3000:]
        assert "dtp_foreign" in log and "dead-lettered" in log, log[-3000:]
        handed_back = log.count("handed back to the queue")
        assert handed_back == FOREIGN_REDELIVERIES, log[-3000:]
        assert f"job {foreign}: nothing to do" not in log
    finally:
        worker.stop()


@pytest.mark.serial  # kills a worker; a wall-time bound
def test_on_redis_a_worker_killed_before_its_claim_costs_the_next_worker_start(tmp_path, postgres_server, redis_broker):
    """Postgres and Redis, workers on other machines (no supervisor): the worker dies holding the job's
    message, before the claim, and nothing restarts it. The next worker to start — a replacement, or one
    more — re-sends the queued jobs nobody holds that were sent before it started, and runs the job at
    once: REQUEUE_AFTER_S is 600 s, so the requeue sweep has no part in it."""
    settings = worker_settings(tmp_path, postgres_server, redis_broker, "preclaim_redis",
                               requeue_after_s=600.0, lease_s=10.0)
    marker = tmp_path / "died-before-claim"
    first = WorkerProcess(settings, tmp_path / "first.log", name="first",
                          faults=Faults(die_before_claim=str(marker))).start()
    job_id = seed_job(settings, status="queued")
    enqueue(make_celery(settings, publisher=True), settings, job_id)
    assert first.proc is not None
    first.proc.wait(timeout=60)
    assert marker.exists() and first.proc.returncode != 0, first.log()[-3000:]
    t0 = time.monotonic()
    second = WorkerProcess(settings, tmp_path / "second.log", name="second").start()
    try:
        deadline, status = time.monotonic() + 150, "queued"
        while time.monotonic() < deadline:
            with database(settings.database_url).session() as session:
                job = session.get(Job, job_id)
                assert job is not None
                status, attempts = job.status, job.attempts
            if status in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.5)
        took = time.monotonic() - t0
        assert status == "succeeded", second.log()[-3000:]
        assert attempts == 1  # the dead worker never claimed it
        kinds = [(e.kind, e.reason or "") for e in _events(settings, job_id)]
        assert any(kind == "requeued" and "(re)started" in reason for kind, reason in kinds), kinds
        assert took < 120, took
        print(f"\nRedis: killed before its claim -> succeeded {took:.1f} s after the next worker started")
    finally:
        second.stop()
