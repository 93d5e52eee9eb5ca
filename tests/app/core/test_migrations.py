"""The Alembic migrations: upgrade to head and downgrade to base, on an empty Postgres database and on
SQLite; and the models match what the migrations create."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError

from app.core.db import Base
from app.core.migrate import REPO_ROOT, downgrade, upgrade

TABLES = {"jobs", "job_events", "layouts", "artifacts", "metrics", "api_keys", "uploads", "upload_files",
          "upload_parts", "derived_data", "derived_needs"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _diff(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return compare_metadata(MigrationContext.configure(conn), Base.metadata)
    finally:
        engine.dispose()


def _metrics_0002_up_and_down(url: str) -> None:
    """0001 → 0002 on a table with rows (a duplicate key among them), then back down to 0001 and up."""
    upgrade(url, "0001")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text(
                "INSERT INTO jobs (id, created_at, updated_at, spec, fingerprint, model_id, devices, delta, score, "
                "status, progress, stages_done, timings, history, cancel_requested, affinity_cached, attempts) "
                "VALUES ('j1', '2026-01-01', '2026-01-01', '{}', 'f', 'm', 2, 1, 'fo', 'running', 0, '[]', '{}', "
                "'[]', false, false, 1)"))
            for step, value in ((0, 1.5), (0, 1.6), (2, 0.9)):
                conn.execute(text("INSERT INTO metrics (job_id, layout, step, name, value, created_at) "
                                  "VALUES ('j1', 'optimised', :step, 'kl', :value, '2026-01-01')"),
                             {"step": step, "value": value})
        upgrade(url, "0002")
        columns = {c["name"] for c in inspect(engine).get_columns("metrics")}
        assert "seed" in columns
        uniques = {u["name"]: u["column_names"] for u in inspect(engine).get_unique_constraints("metrics")}
        assert uniques["uq_metrics_job_layout_seed_step_name"] == ["job_id", "layout", "seed", "step", "name"]
        with engine.begin() as conn:
            rows = conn.execute(text("SELECT seed, step, value FROM metrics ORDER BY step")).all()
        assert [tuple(r) for r in rows] == [(0, 0, 1.5), (0, 2, 0.9)]  # the first of the duplicates kept
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(text("INSERT INTO metrics (job_id, layout, seed, step, name, value, created_at) "
                              "VALUES ('j1', 'optimised', 0, 2, 'kl', 0.8, '2026-01-01')"))
        with engine.begin() as conn:  # another seed is another key
            conn.execute(text("INSERT INTO metrics (job_id, layout, seed, step, name, value, created_at) "
                              "VALUES ('j1', 'optimised', 1, 2, 'kl', 0.8, '2026-01-01')"))
        downgrade(url, "0001")
        assert "seed" not in {c["name"] for c in inspect(engine).get_columns("metrics")}
        assert not inspect(engine).get_unique_constraints("metrics")
        assert "ix_metrics_job_layout_name_step" in {i["name"] for i in inspect(engine).get_indexes("metrics")}
        with engine.begin() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM metrics")).scalar() == 3
        upgrade(url)
        with engine.begin() as conn:
            assert conn.execute(text("SELECT COUNT(*) FROM metrics")).scalar() == 2  # a duplicate again: dropped
        assert _diff(url) == []
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_metrics_seed_migration_up_and_down(postgres_server):
    _metrics_0002_up_and_down(postgres_server.create_database("dtp_migrate"))


def test_sqlite_metrics_seed_migration_up_and_down(tmp_path):
    _metrics_0002_up_and_down(f"sqlite:///{tmp_path / 'db.sqlite'}")


def _api_keys_0003_up_and_down(url: str) -> None:
    """0002 → 0003 adds api_keys (unique names and digests); down to 0002 drops it, jobs untouched."""
    upgrade(url, "0002")
    engine = create_engine(url)
    try:
        assert "api_keys" not in inspect(engine).get_table_names()
        upgrade(url, "0003")
        insert = text("INSERT INTO api_keys (name, tenant, digest, admin, created_at) "
                      "VALUES (:name, 't', :digest, false, '2026-01-01')")
        with engine.begin() as conn:
            conn.execute(insert, {"name": "a", "digest": "0" * 64})
        for dup in ({"name": "a", "digest": "1" * 64}, {"name": "b", "digest": "0" * 64}):
            with pytest.raises(IntegrityError), engine.begin() as conn:
                conn.execute(insert, dup)
        assert "ix_api_keys_tenant" in {i["name"] for i in inspect(engine).get_indexes("api_keys")}
        downgrade(url, "0002")
        assert "api_keys" not in inspect(engine).get_table_names() and "jobs" in inspect(engine).get_table_names()
        upgrade(url)
        assert _diff(url) == []
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_api_keys_migration_up_and_down(postgres_server):
    _api_keys_0003_up_and_down(postgres_server.create_database("dtp_migrate"))


def test_sqlite_api_keys_migration_up_and_down(tmp_path):
    _api_keys_0003_up_and_down(f"sqlite:///{tmp_path / 'db.sqlite'}")


# Two jobs' histories as 0004 stored them: what the worker and the API appended, and oddities (an
# entry that is not an object, one without `at`, an unreadable `at`, a non-array history).
HISTORY_A = [
    {"at": "2026-01-01T00:00:00.5Z", "event": "submitted", "config_checked": True, "key": "ci", "request_id": "req-1"},
    {"at": "2026-01-01T00:00:01Z", "event": "claimed", "worker": "w:1", "attempt": 1},
    {"at": "2026-01-01T00:00:01Z", "event": "stage-start", "stage": "loading", "attempt": 1,
     "device": {"device": "cpu", "name": "cpu", "threads": 2}},
    {"at": "2026-01-01T00:00:03Z", "event": "stage-done", "stage": "loading", "seconds": 2.0, "weights": True},
    {"at": "2026-01-01T00:00:09Z", "event": "requeued", "reason": "lease expired", "requeues": 1},
    "not an object",
    {"event": "cancel-requested", "by": None, "request_id": "req-2"},
    {"at": "yesterday", "event": "cancelled", "stage": "loading", "attempt": 2, "error": "cancelled by request"},
]


def _insert_job(conn, job_id: str, history: object) -> None:
    import json

    conn.execute(text(
        "INSERT INTO jobs (id, created_at, updated_at, spec, fingerprint, model_id, devices, delta, score, status, "
        "progress, stages_done, timings, history, cancel_requested, affinity_cached, attempts) VALUES (:id, "
        "'2026-01-01 00:00:00', '2026-01-01', '{}', 'f', 'm', 2, 1, 'fo', 'cancelled', 0, '[]', '{}', :history, "
        "false, false, 2)"), {"id": job_id, "history": json.dumps(history)})


def _job_events_0005_up_and_down(url: str) -> None:
    """0004 → 0005 moves every history entry into job_events, in order, the facts in their columns; the
    job view reads the same device and timeline from them; down to 0004 rebuilds the arrays."""
    from datetime import datetime

    from sqlalchemy.orm import Session

    from app.core.events import job_events
    from app.core.services.jobs import job_view

    upgrade(url, "0004")
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            _insert_job(conn, "a" * 32, HISTORY_A)
            _insert_job(conn, "b" * 32, {"not": "an array"})
            _insert_job(conn, "c" * 32, [])
        upgrade(url, "0005")
        assert "history" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
        with Session(engine) as session:
            from app.core.db import Job

            rows = job_events(session, "a" * 32)
            assert [e.kind for e in rows] == ["submitted", "claimed", "stage-start", "stage-done", "requeued",
                                             "cancel-requested", "cancelled"]
            submitted, claimed, start, done, requeued, cancel, cancelled = rows
            assert submitted.request_id == "req-1" and submitted.detail == {"config_checked": True, "key": "ci"}
            assert submitted.at == datetime(2026, 1, 1, 0, 0, 0, 500000)
            assert claimed.attempt == 1 and claimed.detail == {"worker": "w:1"}
            assert start.stage == "loading" and start.device == {"device": "cpu", "name": "cpu", "threads": 2}
            assert done.seconds == 2.0 and done.detail == {"weights": True} and done.device is None
            assert requeued.reason == "lease expired" and requeued.detail == {"requeues": 1}
            assert cancel.request_id == "req-2" and cancel.at == datetime(2026, 1, 1)  # no `at`: created_at
            assert cancelled.at == datetime(2026, 1, 1) and cancelled.detail == {"error": "cancelled by request"}
            assert job_events(session, "b" * 32) == [] and job_events(session, "c" * 32) == []
        upgrade(url)  # the job view reads the current model's columns (later migrations add some)
        with Session(engine) as session:
            rows = job_events(session, "a" * 32)
            view = job_view(session.get(Job, "a" * 32), history=rows)
            assert view["device"] == {"device": "cpu", "name": "cpu", "threads": 2}
            assert [(t["stage"], t["state"], t["seconds"]) for t in view["timeline"]] == [
                ("queued", "done", 1.0), ("loading", "done", 2.0)]
        downgrade(url, "0004")
        assert "job_events" not in inspect(engine).get_table_names()
        with engine.begin() as conn:
            histories = dict(conn.execute(text("SELECT id, history FROM jobs")).all())
        import json

        def loaded(value: object) -> object:
            return json.loads(value) if isinstance(value, str) else value

        rebuilt = loaded(histories["a" * 32])
        expected = [e for e in HISTORY_A if isinstance(e, dict)]
        assert [e["event"] for e in rebuilt] == [e["event"] for e in expected]
        for back, before in zip(rebuilt, expected, strict=True):  # every fact kept (empty ones dropped)
            assert {k: v for k, v in back.items() if k != "at"} == \
                {k: v for k, v in before.items() if k != "at" and v is not None}
        assert rebuilt[0]["at"] == "2026-01-01T00:00:00.500000Z"
        assert loaded(histories["b" * 32]) == [] and loaded(histories["c" * 32]) == []
        upgrade(url)
        assert _diff(url) == []
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_postgres_job_events_migration_up_and_down(postgres_server):
    _job_events_0005_up_and_down(postgres_server.create_database("dtp_migrate"))


def test_sqlite_job_events_migration_up_and_down(tmp_path):
    _job_events_0005_up_and_down(f"sqlite:///{tmp_path / 'db.sqlite'}")


@pytest.mark.postgres
def test_postgres_upgrade_head_and_downgrade_base(postgres_server):
    url = postgres_server.create_database("dtp_migrate")
    assert _tables(url) == set()
    upgrade(url)
    assert _tables(url) == TABLES | {"alembic_version"}
    assert _diff(url) == []
    downgrade(url, "base")
    assert _tables(url) == {"alembic_version"}
    upgrade(url)  # and back up again
    assert _tables(url) >= TABLES


def test_sqlite_upgrade_head_and_downgrade_base(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    assert _tables(url) == TABLES | {"alembic_version"}
    assert _diff(url) == []
    downgrade(url, "base")
    assert _tables(url) == {"alembic_version"}


def test_alembic_command_line_reads_the_database_url_from_the_environment(tmp_path):
    url = f"sqlite:///{tmp_path / 'cli.sqlite'}"
    env = {"DTP_LAYOUT_DATABASE_URL": url, "PATH": ""}
    subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], cwd=REPO_ROOT, env=env, check=True,
                   capture_output=True)
    assert _tables(url) >= TABLES
