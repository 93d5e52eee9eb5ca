"""Job events: appended to their own table without touching the job's row, read back by column, and the
job view of a listed page (its events read in one query) the same as the view of one job."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event as sa_event
from sqlalchemy import select

from app.api.main import create_app
from app.core import events
from app.core.caller import OPEN
from app.core.db import Job, JobEvent, database
from app.core.migrate import upgrade
from app.core.schemas.jobs import JobSpec
from app.core.services.jobs import submit_job
from tests.service_kit import make_settings, provision, spec


def _settings(tmp_path, postgres_server=None):
    if postgres_server is None:
        settings = make_settings(tmp_path / "var")
        settings.var_dir.mkdir(parents=True)
    else:
        settings = make_settings(tmp_path / "var", database_url=postgres_server.create_database("dtp_events"))
    upgrade(settings.database_url)
    provision(settings)
    return settings


def _submit(settings) -> str:
    with database(settings.database_url).session() as session:
        return submit_job(session=session, settings=settings, spec=JobSpec.model_validate(spec()), caller=OPEN,
                          enqueue=lambda _jid: None, request_id="req-7").id


def _appending(settings) -> None:
    db = database(settings.database_url)
    job_id = _submit(settings)
    with db.session() as session:
        before = {c.name: getattr(session.get(Job, job_id), c.key) for c in Job.__table__.columns}
    statements: list[str] = []

    def seen(_conn, _cursor, statement, *_args):
        statements.append(statement.split()[0].upper())

    sa_event.listen(db.engine, "before_cursor_execute", seen)
    try:
        with db.transaction() as session:
            for n in range(50):
                events.record(session, job_id, events.STAGE_START, stage="loading", attempt=n,
                              device={"device": f"cuda:{n % 2}"} if n % 5 == 0 else None)
            events.record(session, job_id, events.REQUEUED, reason="lease expired")
            events.record(session, job_id, events.REQUEUED)  # no reason: the last reason stays
    finally:
        sa_event.remove(db.engine, "before_cursor_execute", seen)
    assert "UPDATE" not in statements and "INSERT" in statements, statements
    with db.session() as session:
        after = {c.name: getattr(session.get(Job, job_id), c.key) for c in Job.__table__.columns}
        rows = events.job_events(session, job_id)
        assert after == before  # the job's row was not rewritten
        assert [e.kind for e in rows] == ["submitted", *["stage-start"] * 50, "requeued", "requeued"]
        assert [e.attempt for e in rows[1:51]] == list(range(50))  # in the order appended
        assert events.submitted_request_id(session, job_id) == "req-7"
        assert events.last_requeue_reason(session, job_id) == "lease expired"
        assert events.device(rows) == {"device": "cuda:1"}  # attempt 45's, the latest recorded
        assert session.scalar(select(JobEvent.device).where(  # SQL NULL, not JSON null, when absent
            JobEvent.job_id == job_id, JobEvent.device.is_(None)).limit(1)) is None
        assert events.count(session, events.REQUEUED) == 2


def test_events_are_appended_without_rewriting_the_job_sqlite(tmp_path):
    _appending(_settings(tmp_path))


@pytest.mark.postgres
def test_events_are_appended_without_rewriting_the_job_postgres(tmp_path, postgres_server):
    _appending(_settings(tmp_path, postgres_server))


def _fixed(entry: dict) -> dict:
    """A timeline entry without what grows while it runs (its seconds so far)."""
    return {k: v for k, v in entry.items() if not (k == "seconds" and entry["state"] == "running")}


def test_listed_jobs_show_the_same_device_and_timeline_as_one_job(tmp_path):
    settings = _settings(tmp_path)
    ids = [_submit(settings) for _ in range(3)]
    with database(settings.database_url).transaction() as session:
        events.record(session, ids[1], events.CLAIMED, attempt=1, worker="w:1")
        events.record(session, ids[1], events.STAGE_START, stage="loading", attempt=1, device={"device": "cpu"})
        events.record(session, ids[1], events.STAGE_DONE, stage="loading", attempt=1, seconds=0.25)
    with TestClient(create_app(settings)) as client:
        listed = {j["id"]: j for j in client.get("/v1/jobs").json()["items"]}
        for job_id in ids:
            one = client.get(f"/v1/jobs/{job_id}").json()
            assert listed[job_id]["device"] == one["device"]
            assert [_fixed(t) for t in listed[job_id]["timeline"]] == [_fixed(t) for t in one["timeline"]]
    assert listed[ids[1]]["device"] == {"device": "cpu"} and listed[ids[0]]["device"] is None
    assert [(t["stage"], t["state"], t["seconds"]) for t in listed[ids[1]]["timeline"][1:]] == [
        ("loading", "done", 0.25)]
