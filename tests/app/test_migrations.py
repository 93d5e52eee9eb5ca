"""The Alembic migrations: upgrade to head and downgrade to base, on an empty Postgres database and on
SQLite; and the models match what the migrations create."""

from __future__ import annotations

import subprocess
import sys

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from app.db import Base
from app.migrate import REPO_ROOT, downgrade, upgrade

TABLES = {"jobs", "layouts", "artifacts", "metrics"}


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
