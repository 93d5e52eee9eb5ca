"""Migration 0008 (issue 43): jobs.schedule backfilled from each stored spec, canonical, and jobs.delta
dropped (δ derived); down to 0007 δ comes back as the column held it. On Postgres and on SQLite."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.orm import Session

from app.core.migrate import downgrade, upgrade
from tests.app.core.test_migrations import _diff

# id → (the spec as stored, the row's δ column, the schedule 0008 must give it, Job.delta after it)
ROWS: dict[str, tuple[dict, int, str, int]] = {
    "dtp-shorthand": ({"delta": 1, "schedule": None}, 1, "dtp:1", 1),  # a spec's `delta: 1` alone
    "dtp-two": ({"delta": 2}, 2, "dtp:2", 2),  # no `schedule` key (a spec from before schedules)
    "pt": ({"delta": 1, "schedule": "pt:2"}, 1, "pt:2", 1),  # δ 1 stays the layouts' δ
    "spd-alias": ({"delta": 1, "schedule": "spd:3,01"}, 1, "spd:1,3", 1),  # the grammar's canonical form
    "partial-alias": ({"delta": 1, "schedule": "dtp:1@004"}, 1, "dtp:1@4", 1),
    "empty-spec": ({}, 3, "dtp:3", 3),  # nothing in the spec: the row's δ
    "unreadable": ({"delta": 1, "schedule": "warp:9"}, 1, "warp:9", 1),  # kept as it was: no filter matches it
}


def _insert(conn, job_id: str, spec: dict, delta: int) -> None:
    conn.execute(text(
        "INSERT INTO jobs (id, created_at, updated_at, spec, fingerprint, model_id, devices, delta, score, status, "
        "progress, stages_done, timings, cancel_requested, affinity_cached, attempts) VALUES (:id, '2026-01-01', "
        "'2026-01-01', :spec, 'f', 'm', 2, :delta, 'fo', 'succeeded', 1, '[]', '{}', false, false, 1)"),
        {"id": job_id, "spec": json.dumps(spec), "delta": delta})


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path) -> str:
    """An empty database of each kind the migrations run on."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'db.sqlite'}"
    return request.getfixturevalue("postgres_server").create_database("dtp_migrate")


@pytest.fixture
def engine(database_url):
    made = create_engine(database_url)
    yield made
    made.dispose()


def test_the_schedule_migration_backfills_and_goes_back(database_url, engine):
    from app.core.db import Job

    url = database_url
    upgrade(url, "0007")
    with engine.begin() as conn:
        for job_id, (spec, delta, _, _) in ROWS.items():
            _insert(conn, job_id, spec, delta)
    upgrade(url, "0008")
    columns = {c["name"]: c for c in inspect(engine).get_columns("jobs")}
    assert "delta" not in columns and columns["schedule"]["nullable"] is False
    with engine.begin() as conn:
        stored = dict(conn.execute(text("SELECT id, schedule FROM jobs")).all())
    assert stored == {job_id: row[2] for job_id, row in ROWS.items()}
    upgrade(url)
    with Session(engine) as session:
        assert {job.id: job.delta for job in session.query(Job)} == {job_id: row[3] for job_id, row in ROWS.items()}
    downgrade(url, "0007")
    assert "schedule" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    with engine.begin() as conn:
        deltas = dict(conn.execute(text("SELECT id, delta FROM jobs")).all())
    assert deltas == {job_id: row[1] for job_id, row in ROWS.items()}
    upgrade(url)
    assert _diff(url) == []
