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

TABLES = {"jobs", "layouts", "artifacts", "metrics", "api_keys"}


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
