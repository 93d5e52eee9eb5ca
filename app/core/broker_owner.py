"""Which database a broker serves: a marker the broker carries, so that two services never share one.

A worker takes any message on its queue; one of another service (another database) names a job its
own database does not hold. `serve` and `worker` therefore mark the broker with their database's
identity when they start and refuse to start when the broker already carries another's:

- the embedded SQLite broker: a one-row table `dtp_layout_broker_owner` in the broker's file;
- Redis: the key `{BROKER_KEY_PREFIX}dtp-layout:broker-owner` in the broker's database.

A database's identity is what names it whatever URL reaches it: PostgreSQL's system identifier and
database name (two host names for one server agree), a SQLite file's resolved path. Other brokers
(AMQP) carry no marker: each worker then logs the foreign messages it meets (worker/tasks.py).

A worker of another database that drops a job's message (after a few deliveries: worker/tasks.py)
cannot write to the job's database; it leaves a note in the broker both share instead —
`{BROKER_KEY_PREFIX}dtp-layout:dead-letter:{job id}` on Redis (expiring after DEAD_LETTER_TTL_S), the
table `dtp_layout_dead_letters` in the embedded broker's file — and the sweeper of the job's own
service fails each queued job that has one, with the note's reason (`fail_dead_lettered`; issue 41:
such a job stayed `queued` for ever).
Torch-free.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from app.core import events
from app.core.db import Database, Job, utcnow
from app.core.settings import Settings, redacted_url

REDIS_KEY = "dtp-layout:broker-owner"
SQLITE_TABLE = "dtp_layout_broker_owner"
DEAD_LETTER_KEY = "dtp-layout:dead-letter:"
DEAD_LETTER_TABLE = "dtp_layout_dead_letters"
DEAD_LETTER_TTL_S = 7 * 86400


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


# ---- dead letters ---------------------------------------------------------------------------------------

def _redis(settings: Settings) -> Any:
    import redis

    return redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=5)


def _is_redis(settings: Settings) -> bool:
    return settings.broker_url.startswith(("redis://", "rediss://"))


def _dead_letter_table(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30)
    conn.execute(f"CREATE TABLE IF NOT EXISTS {DEAD_LETTER_TABLE} (job_id TEXT PRIMARY KEY, reason TEXT NOT NULL, "
                 "at REAL NOT NULL)")
    return conn


def note_dead_letter(settings: Settings, job_id: str, reason: str) -> bool:
    """Leave the note for the job's own service; False where the broker carries none."""
    reason = reason[:1000]
    if _is_redis(settings):
        client = _redis(settings)
        try:
            client.set(f"{settings.broker_key_prefix or ''}{DEAD_LETTER_KEY}{job_id}", reason, ex=DEAD_LETTER_TTL_S)
        finally:
            client.close()
        return True
    path = sqlite_broker_file(settings.broker_url)
    if path is None:
        return False
    conn = _dead_letter_table(path)
    try:
        with conn:
            conn.execute(f"INSERT OR REPLACE INTO {DEAD_LETTER_TABLE} (job_id, reason, at) VALUES (?, ?, ?)",
                         (job_id, reason, time.time()))
    finally:
        conn.close()
    return True


def dead_letter_notes(settings: Settings, job_ids: Sequence[str]) -> dict[str, str]:
    """The notes left for any of `job_ids` (job id → reason)."""
    if not job_ids:
        return {}
    if _is_redis(settings):
        client = _redis(settings)
        try:
            values = client.mget([f"{settings.broker_key_prefix or ''}{DEAD_LETTER_KEY}{j}" for j in job_ids])
        finally:
            client.close()
        return {j: v.decode(errors="replace") for j, v in zip(job_ids, values, strict=True) if v is not None}
    path = sqlite_broker_file(settings.broker_url)
    if path is None or not path.is_file():
        return {}
    conn = _dead_letter_table(path)
    try:
        marks = ",".join("?" * len(job_ids))
        rows = conn.execute(f"SELECT job_id, reason FROM {DEAD_LETTER_TABLE} WHERE job_id IN ({marks})", list(job_ids))
        return {str(j): str(r) for j, r in rows}
    finally:
        conn.close()


def fail_dead_lettered(db: Database, settings: Settings) -> list[str]:
    """Fail each queued job nobody holds that a worker of another database dropped, with the reason."""
    with db.session() as session:
        queued = session.scalars(select(Job.id).where(Job.status == "queued", Job.lease_until.is_(None))
                                 .order_by(Job.created_at).limit(500)).all()
    failed = []
    for job_id, reason in dead_letter_notes(settings, list(queued)).items():
        error = (f"no worker of this service took it: a worker of another database sharing the broker dropped "
                 f"its message ({reason}); give each service a broker of its own, then submit it again")
        with db.transaction() as session:
            now = utcnow()
            done = session.execute(
                update(Job).where(Job.id == job_id, Job.status == "queued", Job.lease_until.is_(None))
                .values(status="failed", error=error, finished_at=now, updated_at=now, eta_s=None)
                .execution_options(synchronize_session=False))
            if done.rowcount == 1:  # type: ignore[attr-defined]
                events.record(session, job_id, "failed", error=error)
                failed.append(job_id)
    return failed
