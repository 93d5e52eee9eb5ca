"""Which database a broker serves: a marker the broker carries, so that two services never share one.

A worker takes any message on its queue; one of another service (another database) names a job its
own database does not hold. `serve` and `worker` therefore mark the broker with their database's
identity when they start and refuse to start when the broker already carries another's:

- the embedded SQLite broker: a one-row table `dtp_layout_broker_owner` in the broker's file;
- Redis: the key `{BROKER_KEY_PREFIX}dtp-layout:broker-owner` in the broker's database.

A database's identity is what names it whatever URL reaches it: PostgreSQL's system identifier and
database name (two host names for one server agree), a SQLite file's resolved path. Other brokers
(AMQP) carry no marker: each worker then logs the foreign messages it meets (worker/tasks.py).
Torch-free.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from app.core.settings import Settings, redacted_url

REDIS_KEY = "dtp-layout:broker-owner"
SQLITE_TABLE = "dtp_layout_broker_owner"


def database_identity(database_url: str) -> str:
    """A name for the database that does not depend on how its URL spells the host or path."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite":
        path = url.database or ""
        return f"sqlite:{Path(path).expanduser().resolve()}" if path and path != ":memory:" else "sqlite::memory:"
    if url.get_backend_name() == "postgresql":
        engine = create_engine(url, pool_pre_ping=False, connect_args={"connect_timeout": 5})
        try:
            with engine.connect() as conn:
                name = conn.execute(text("SELECT current_database()")).scalar()
                try:
                    system = conn.execute(text("SELECT system_identifier FROM pg_control_system()")).scalar()
                except DBAPIError:  # the function's EXECUTE revoked: the URL's host and port name the server
                    system = f"{url.host}:{url.port or 5432}"
        finally:
            engine.dispose()
        return f"postgresql:{system}/{name}"
    return redacted_url(database_url)


def sqlite_broker_file(broker_url: str) -> Path | None:
    """The embedded broker's file (a sqla+sqlite URL's path); None for another broker."""
    for scheme in ("sqla+sqlite:///", "sqlalchemy+sqlite:///"):
        if broker_url.startswith(scheme) and len(broker_url) > len(scheme):
            return Path(broker_url[len(scheme):].split("?", 1)[0])
    return None


def _mark_sqlite(path: Path, identity: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path, timeout=30) as conn:
        conn.execute(f"CREATE TABLE IF NOT EXISTS {SQLITE_TABLE} (id INTEGER PRIMARY KEY CHECK (id = 1), "
                     "database TEXT NOT NULL)")
        conn.execute(f"INSERT OR IGNORE INTO {SQLITE_TABLE} (id, database) VALUES (1, ?)", (identity,))
        row = conn.execute(f"SELECT database FROM {SQLITE_TABLE} WHERE id = 1").fetchone()
    conn.close()
    return str(row[0])


def _mark_redis(settings: Settings, identity: str) -> str:
    import redis

    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=5)
    try:
        key = f"{settings.broker_key_prefix or ''}{REDIS_KEY}"
        client.set(key, identity, nx=True)
        owner = client.get(key)
    finally:
        client.close()
    return owner.decode() if isinstance(owner, bytes) else str(owner)


def mark_broker(settings: Settings) -> str | None:
    """Mark the broker as serving this service's database; the refusal to print when it already serves
    another (None: marked, or a broker that carries no marker)."""
    identity = database_identity(settings.database_url)
    sqlite_file = sqlite_broker_file(settings.broker_url)
    if sqlite_file is not None:
        owner = _mark_sqlite(sqlite_file, identity)
    elif settings.broker_url.startswith(("redis://", "rediss://")):
        owner = _mark_redis(settings, identity)
    else:
        return None
    if owner == identity:
        return None
    return (f"the broker {redacted_url(settings.broker_url)} already serves another database ({owner}); this "
            f"service's is {identity}. Two services sharing a broker take each other's messages: give this one "
            "a broker of its own (DTP_LAYOUT_BROKER_URL, or DTP_LAYOUT_BROKER_KEY_PREFIX on a shared Redis), or "
            "unset DTP_LAYOUT_BROKER_URL to use the embedded broker derived from the database's location")
