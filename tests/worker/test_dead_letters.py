"""A dead-lettered job is failed with its reason (issue 41): a worker of database A takes the message of a
job only database B holds (a broker shared against the rule the services now check at start), hands it back
FOREIGN_REDELIVERIES times and drops it. The job stayed `queued` in B for ever; now the dropping worker leaves
a note in the broker and B's sweeper (app.core.broker_owner.fail_dead_lettered, run by every worker's
sweep) fails the job with the note's reason. On the real Postgres and Redis, with a real Celery worker."""

from __future__ import annotations

import time

import pytest

from app.core.broker_owner import fail_dead_lettered
from app.core.db import Job, JobEvent, database
from app.core.migrate import upgrade
from app.core.queue import enqueue, make_celery
from tests.service_kit import WorkerProcess, make_settings, provision, seed_job

pytestmark = [pytest.mark.postgres, pytest.mark.redis]


def test_a_job_whose_message_another_databases_worker_dropped_is_failed_with_the_reason(tmp_path, postgres_server,
                                                                                         redis_broker):
    broker, prefix = redis_broker
    shared = {"broker_url": broker, "broker_key_prefix": f"{prefix}dead:", "device": "cpu"}
    a_url, b_url = postgres_server.create_database("dtp_dead_a"), postgres_server.create_database("dtp_dead_b")
    upgrade(a_url)
    upgrade(b_url)
    a = make_settings(tmp_path / "a", database_url=a_url, **shared)
    b = make_settings(tmp_path / "b", database_url=b_url, **shared)
    provision(a)
    provision(b)
    job_id = seed_job(b, status="queued")
    worker = WorkerProcess(a, tmp_path / "worker-a.log").start()
    try:
        enqueue(make_celery(b, publisher=True), b, job_id)  # B's message, taken by A's worker
        deadline = time.monotonic() + 90
        while "dead-lettered" not in worker.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "dead-lettered" in worker.log(), worker.log()[-3000:]
    finally:
        worker.stop()
    assert fail_dead_lettered(database(a_url), a) == []  # not A's job: A fails nothing
    db = database(b_url)
    assert fail_dead_lettered(db, b) == [job_id]
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job.status == "failed" and job.finished_at is not None, job.status
        assert "another database sharing the broker dropped its message" in job.error, job.error
        assert "dropped after 4 deliveries" in job.error and "dtp_dead_a" not in job.error, job.error  # no URL
        kinds = [e.kind for e in session.query(JobEvent).filter(JobEvent.job_id == job_id)]
    assert kinds[-1] == "failed", kinds
    assert fail_dead_lettered(db, b) == []  # once
