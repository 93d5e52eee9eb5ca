"""Jobs that never stay stuck, run in this process against real databases (the worker's code paths
without the Celery shim): the stored spec validated again, stalls retried then failed, cancel inside a
hung loading or calibration, attempt fencing, leases on the database clock, sweepers, per-attempt
work directories, metrics past the bind-parameter limits."""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from app.core.caller import OPEN
from app.core.db import Job, LayoutRow, Metric, database, db_now
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import submit_job
from tests.service_kit import job_history, make_settings, provision, spec
from worker import failures, metrics, publishing
from worker import run as job_run
from worker.entry import run_job
from worker.jobs import (
    JobRun,
    Lease,
    LeaseLost,
    Monitor,
    claim,
    requeue_queued,
    requeue_stale,
    upsert_metrics,
)


def sqlite_settings(root, **overrides):
    settings = make_settings(root, device="cpu", **overrides)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.database_url)
    provision(settings)
    return settings


def postgres_job(root, postgres_server, name):
    """(settings, database, a queued job's id) on a fresh, migrated Postgres database."""
    url = postgres_server.create_database(name)
    upgrade(url)
    settings = make_settings(root, database_url=url, device="cpu")
    provision(settings)
    return settings, database(url), submit(settings)


def submit(settings, body=None, sent=None):
    """A queued job as the API records it; `sent` collects the ids "enqueued" (None: the message is lost)."""
    db = database(settings.database_url)
    with db.session() as session:
        job = submit_job(session=session, settings=settings, spec=JobSpec.model_validate(body or spec()),
                         caller=OPEN, enqueue=(sent.append if sent is not None else lambda _jid: None))
    return job.id


def row(settings, job_id):
    with database(settings.database_url).session() as session:
        return session.get(Job, job_id)


def events(settings, job_id):
    return Counter(e["event"] for e in job_history(settings, job_id))


def test_stored_spec_that_no_longer_validates_fails_with_the_reason(tmp_path):
    settings = sqlite_settings(tmp_path)
    job_id = submit(settings)
    db = database(settings.database_url)
    with db.transaction() as session:
        job = session.get(Job, job_id)
        job.spec = {**job.spec, "devices": "many", "delta": -3}  # what an older or newer schema may hold
    assert run_job(job_id, settings=settings, db=db, worker="w:1") == "failed"
    job = row(settings, job_id)
    assert job.status == "failed" and job.lease_until is None and job.finished_at is not None
    assert job.error.startswith("the stored job spec no longer validates: ") and "devices" in job.error, job.error


@pytest.mark.serial  # a wall-time bound (< 8 s)
def test_stalled_run_is_retried_then_failed_with_the_reason(tmp_path, inject_faults):
    """A loading stage that never returns and never reports progress (a hung download)."""
    inject_faults(hang_stage="loading")
    settings = sqlite_settings(tmp_path, stall_s=1.0, lease_s=3.0, max_attempts=2)
    db = database(settings.database_url)
    job_id = submit(settings)
    resent: list[str] = []
    t0 = time.monotonic()
    assert run_job(job_id, settings=settings, db=db, worker="w:1", enqueue=resent.append) == "retried"
    assert time.monotonic() - t0 < 8
    job = row(settings, job_id)
    assert resent == [job_id] and job.status == "queued" and job.worker is None and job.lease_until is None
    assert job.requeues == 1 and job.attempts == 1
    requeued = [e for e in job_history(settings, job_id) if e["event"] == "requeued"]
    assert requeued[-1]["reason"].startswith("stalled in stage loading for 1 s"), requeued

    assert run_job(job_id, settings=settings, db=db, worker="w:2", enqueue=resent.append) == "failed"
    job = row(settings, job_id)
    assert job.status == "failed" and job.attempts == 2 and job.error_stage == "loading"
    assert job.error.startswith("gave up after 2 attempts: stalled in stage loading for "), job.error
    assert resent == [job_id]


def test_soft_time_limit_fails_the_job(tmp_path, inject_faults):
    inject_faults(hang_stage="calibration")
    settings = sqlite_settings(tmp_path, time_limit_s=1.5, time_limit_per_mtoken_s=0)
    db = database(settings.database_url)
    job_id = submit(settings)
    assert settings.time_limits(8 * 32) == (1.5, 1.5 * 1.1 + 60)
    assert run_job(job_id, settings=settings, db=db, worker="w:1") == "failed"
    job = row(settings, job_id)
    assert job.error_stage == "calibration" and "exceeded its time limit of 1.5 s" in job.error, job.error


def test_hard_time_limit_fails_the_job_and_calls_the_kill(tmp_path, inject_faults):
    """A run stuck where no check interrupts it (affinity, in native code say): past the hard limit the
    job is failed with the reason and the kill action runs (the Celery task SIGKILLs its process)."""
    inject_faults(hang_stage="affinity")
    settings = sqlite_settings(tmp_path, time_limit_s=3.0, time_limit_per_mtoken_s=0, time_limit_grace_s=0.0)
    db = database(settings.database_url)
    job_id = submit(settings)
    killed = threading.Event()
    stuck = threading.Thread(target=run_job, args=(job_id,), kwargs=dict(settings=settings, db=db, worker="w:1",
                                                                          on_hard_limit=killed.set), daemon=True)
    stuck.start()  # never returns: its thread stays hung, as the worker's would until killed
    assert killed.wait(30)
    job = row(settings, job_id)
    assert job.status == "failed" and job.error_stage == "affinity" and stuck.is_alive()
    assert job.error.startswith("exceeded its hard time limit of 3.3 s in stage affinity"), job.error


def test_time_limits_grow_with_the_job_and_are_bounded(tmp_path):
    settings = make_settings(tmp_path, time_limit_s=100, time_limit_per_mtoken_s=50, time_limit_max_s=1000,
                             time_limit_grace_s=60)
    assert settings.time_limits(0) == (100, 170)
    assert settings.time_limits(4_000_000) == (300, 390)
    assert settings.time_limits(10**9)[0] == 1000


@pytest.mark.serial  # a latency bound (< 3 s)
@pytest.mark.parametrize("stage", ["loading", "calibration", "optimising"])
def test_cancel_is_honoured_within_seconds_in_a_hung_stage(tmp_path, stage, inject_faults):
    from app.core.services.jobs import cancel_job

    inject_faults(hang_stage=stage)
    settings = sqlite_settings(tmp_path, lease_s=3.0)
    db = database(settings.database_url)
    job_id = submit(settings)
    result: list[str] = []
    runner = threading.Thread(target=lambda: result.append(run_job(job_id, settings=settings, db=db, worker="w:1")))
    runner.start()
    deadline = time.monotonic() + 30
    while row(settings, job_id).stage != stage and time.monotonic() < deadline:
        time.sleep(0.05)
    assert row(settings, job_id).stage == stage
    with db.session() as session:
        cancel_job(session=session, job_id=job_id, caller=OPEN)
    t0 = time.monotonic()
    runner.join(timeout=10)
    assert result == ["cancelled"] and time.monotonic() - t0 < 3
    job = row(settings, job_id)
    assert job.status == "cancelled" and job.stage == stage


@pytest.mark.postgres
def test_fencing_by_attempt_and_leases_on_the_database_clock(tmp_path, postgres_server, monkeypatch):
    settings, db, job_id = postgres_job(tmp_path, postgres_server, "dtp_fence")
    # The worker's clock is an hour off: leases still follow the database's.
    for module in (job_run, publishing, failures, metrics):
        monkeypatch.setattr(module, "utcnow", _skewed)
    first = claim(db, job_id, worker="same:1", lease_s=30)
    with db.session() as session:
        now = session.scalar(select(db_now()))
    assert first is not None and abs((first.lease_until - now).total_seconds() - 30) < 2
    assert claim(db, job_id, worker="other:2", lease_s=30) is None  # leased
    assert requeue_stale(db, lambda _jid: None) == []  # not expired by the database's clock

    # The lease runs out (the worker was presumed dead); the same worker name claims attempt 2.
    with db.transaction() as session:
        session.execute(update(Job).where(Job.id == job_id).values(lease_until=db_now(-1)))
    sent: list[str] = []
    assert requeue_stale(db, sent.append) == [job_id] and sent == [job_id]
    second = claim(db, job_id, worker="same:1", lease_s=30)
    assert second is not None and second.attempts == 2

    stale = JobRun(db=db, settings=settings, job=first, spec=JobSpec.model_validate(first.spec), worker="same:1",
                   monitor=Monitor(db, Lease(job_id, "same:1", 1), 30))
    assert stale.attempt == 1
    with pytest.raises(LeaseLost):
        stale.write_metrics([{"layout": "optimised", "seed": 0, "step": 0, "kl": 1.0}])
    with pytest.raises(LeaseLost):
        stale.complete("optimising", lambda session, _job: session.add(_layout(job_id)))
    with pytest.raises(LeaseLost):
        stale.enter("affinity")
    stale.monitor.flush()
    assert stale.monitor.lost.is_set()
    live = Monitor(db, Lease(job_id, "same:1", 2), 30)
    live.flush()
    assert not live.lost.is_set()
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id)) == 0
        assert session.scalar(select(func.count()).select_from(LayoutRow).where(LayoutRow.job_id == job_id)) == 0
    assert row(settings, job_id).requeues == 1


def _skewed():
    from datetime import UTC, datetime

    return datetime.now(UTC).replace(tzinfo=None) - timedelta(hours=1)


def _layout(job_id):
    return LayoutRow(job_id=job_id, name="optimised", J=1.0, random_expectation=0.5, upper_bound=2.0,
                     upper_bound_exact=True, up_fraction=[], down_fraction=[], kv_group_device=[],
                     neuron_device=[], shape={}, score={})


@pytest.mark.postgres
@pytest.mark.redis
def test_queued_sweeper_resends_lost_messages_once_per_period(tmp_path, postgres_server, redis_broker):
    """Crash between insert and enqueue, then the broker purged: each time the job is sent again, by
    one sweeper, once per period; the messages really reach Redis."""
    import redis

    from app.core.queue import enqueue, make_celery
    from tests.service_kit import worker_settings

    period = 30.0  # far longer than a send can take on a busy machine: the second sweep is inside it
    settings = worker_settings(tmp_path, postgres_server, redis_broker, "sweep", requeue_after_s=period)
    db = database(settings.database_url)
    celery = make_celery(settings)
    job_id = submit(settings)  # inserted; the message never sent
    client = redis.Redis.from_url(redis_broker[0])
    queue_key = f"{settings.broker_key_prefix}{settings.queue}"

    def period_passes() -> None:  # the message's send time moved a period back, as if one had elapsed
        with db.transaction() as session:
            session.execute(update(Job).where(Job.id == job_id)
                            .values(enqueued_at=Job.enqueued_at - timedelta(seconds=period + 1)))

    assert requeue_queued(db, lambda jid: None, after_s=period) == []  # younger than the period
    period_passes()
    sweepers = [lambda: requeue_queued(db, lambda jid: enqueue(celery, settings, jid), after_s=period)
                for _ in range(2)]
    assert [s() for s in sweepers] == [[job_id], []]  # one sweeper wins; the other is inside the new period
    assert client.llen(queue_key) == 1
    client.delete(queue_key)  # the broker lost it (purged, restarted without persistence)
    period_passes()
    assert requeue_queued(db, lambda jid: enqueue(celery, settings, jid), after_s=period) == [job_id]
    assert client.llen(queue_key) == 1
    job = row(settings, job_id)
    assert job.status == "queued" and job.requeues == 2 and events(settings, job_id)["requeued"] == 2
    # A duplicate message is harmless: the first claim runs the job, the second finds nothing to do.
    assert claim(db, job_id, worker="w:1", lease_s=30) is not None
    assert claim(db, job_id, worker="w:2", lease_s=30) is None
    client.delete(queue_key)


def test_each_attempt_has_its_own_work_directory(tmp_path):
    settings = sqlite_settings(tmp_path)
    db = database(settings.database_url)
    job_id = submit(settings)
    job = claim(db, job_id, worker="w:1", lease_s=30)
    first = JobRun(db=db, settings=settings, job=job, spec=JobSpec.model_validate(job.spec), worker="w:1",
                   monitor=Monitor(db, Lease(job_id, "w:1", 1), 30))
    first.prepare_work()
    (first.work / "blocks.npy").write_bytes(b"blocks")
    (first.work / "shards").mkdir()
    (first.work / "shards" / "rank0.safetensors").write_bytes(b"partial")
    with db.transaction() as session:
        session.execute(update(Job).where(Job.id == job_id).values(lease_until=db_now(-1)))
    job = claim(db, job_id, worker="w:2", lease_s=30)
    second = JobRun(db=db, settings=settings, job=job, spec=JobSpec.model_validate(job.spec), worker="w:2",
                    monitor=Monitor(db, Lease(job_id, "w:2", 2), 30))
    second.prepare_work()
    assert second.work != first.work and second.work.name == "2"
    assert (second.work / "blocks.npy").read_bytes() == b"blocks"
    assert not (second.work / "shards").exists()  # exports are redone, never resumed from a dead run's files
    assert not first.work.exists()


def test_a_job_from_before_per_attempt_directories_resumes_from_its_files(tmp_path):
    settings = sqlite_settings(tmp_path)
    db = database(settings.database_url)
    job_id = submit(settings)
    legacy = settings.storage / "jobs" / job_id / "work"
    (legacy / "layouts").mkdir(parents=True)
    (legacy / "layouts" / "optimised.json").write_text("{}")
    (legacy / "blocks.npy").write_bytes(b"blocks")
    (legacy / "checkpoint").mkdir()
    job = claim(db, job_id, worker="w:1", lease_s=30)
    run = JobRun(db=db, settings=settings, job=job, spec=JobSpec.model_validate(job.spec), worker="w:1",
                 monitor=Monitor(db, Lease(job_id, "w:1", 1), 30))
    run.prepare_work()
    assert run.work == legacy / "1" and (run.work / "blocks.npy").read_bytes() == b"blocks"
    assert (run.work / "layouts" / "optimised.json").is_file() and not (run.work / "checkpoint").exists()


@pytest.mark.postgres
def test_metrics_past_the_bind_parameter_limit(tmp_path, postgres_server):
    """A long distillation's rows in one call: more distinct steps than Postgres' 65535 bind parameters
    (SQLite's default limit, 32766, is lower still)."""
    _settings, db, job_id = postgres_job(tmp_path, postgres_server, "dtp_metrics")
    n = 66_000
    rows = [{"layout": "optimised", "seed": 0, "step": step, "kl": step / n} for step in range(n)]
    with db.transaction() as session:
        upsert_metrics(session, job_id, rows)
    rows = rows[-1500:]
    rows[-1]["kl"] = 2.0
    with db.transaction() as session:
        upsert_metrics(session, job_id, rows)  # rewritten: updated in place
    with db.session() as session:
        assert session.scalar(select(func.count()).select_from(Metric).where(Metric.job_id == job_id)) == n
        assert session.scalar(select(Metric.value).where(Metric.job_id == job_id, Metric.step == n - 1)) == 2.0


def test_stall_stops_the_lease_renewal(tmp_path):
    settings = sqlite_settings(tmp_path)
    db = database(settings.database_url)
    job_id = submit(settings)
    claim(db, job_id, worker="w:1", lease_s=30)
    monitor = Monitor(db, Lease(job_id, "w:1", 1), 30, stall_s=0.3)
    monitor.flush()
    renewed = row(settings, job_id).lease_until
    time.sleep(0.4)
    monitor.flush()
    assert monitor.stalled.is_set() and row(settings, job_id).lease_until == renewed
    monitor.report(0.5)  # progress after the stall does not take the lease back: the run is abandoned
    monitor.flush()
    assert row(settings, job_id).lease_until == renewed


@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.worker
def test_worker_sweeper_sends_a_job_whose_message_never_left(tmp_path, postgres_server, redis_broker):
    """The API crashed between recording the job and enqueueing it: a real worker's sweeper finds the
    job, sends it, and the worker runs it once (the worker starting after the job was recorded, its
    start sweep is the one that finds it: worker/claiming.py `requeue_unclaimed`)."""
    from tests.service_kit import WorkerProcess, worker_settings

    settings = worker_settings(tmp_path, postgres_server, redis_broker, "lostmsg", requeue_after_s=1.0)
    job_id = submit(settings, spec(random_layouts=0, ablations=False, export={"checkpoint": False,
                                                                              "shards": False}))
    worker = WorkerProcess(settings, tmp_path / "worker.log").start()
    try:
        deadline = time.monotonic() + 90
        while row(settings, job_id).status in ("queued", "running") and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        worker.stop()
    job = row(settings, job_id)
    assert job.status == "succeeded", (job.status, job.error, worker.log()[-3000:])
    assert job.requeues >= 1 and events(settings, job_id)["claimed"] == 1 and events(settings, job_id)["succeeded"] == 1
    assert "queued and unclaimed when this worker started; sent again" in worker.log()
