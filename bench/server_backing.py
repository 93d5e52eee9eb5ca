"""A fresh Postgres database and Redis key prefix for a bench's service, and their removal (bench/load.py,
bench/submit_latency.py). Torch-free."""

from __future__ import annotations

import os
import uuid

POSTGRES_ADMIN_URL = os.environ.get("DTP_LAYOUT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("DTP_LAYOUT_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _admin_dsn() -> str:
    from sqlalchemy.engine import make_url

    return make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql").render_as_string(hide_password=False)


def create_backing(tag: str) -> tuple[str, str, dict[str, str]]:
    """(database, Redis prefix, the service's environment for them): a new database `dtp_TAG_…`."""
    import psycopg
    from sqlalchemy.engine import make_url

    database = f"dtp_{tag}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_admin_dsn(), autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    prefix = f"dtp-{tag}-{uuid.uuid4().hex[:12]}:"
    url = make_url(POSTGRES_ADMIN_URL).set(database=database).render_as_string(hide_password=False)
    return database, prefix, {"DTP_LAYOUT_DATABASE_URL": url, "DTP_LAYOUT_BROKER_URL": REDIS_URL,
                              "DTP_LAYOUT_BROKER_KEY_PREFIX": prefix}


def drop_backing(database: str | None, prefix: str | None) -> None:
    """Drop the database (connections forced off) and delete the prefix's Redis keys; None: nothing."""
    if database:
        import psycopg

        with psycopg.connect(_admin_dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    if prefix:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{prefix}*"):
            client.delete(key)
        client.close()
