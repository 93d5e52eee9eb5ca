"""Jobs whose message a worker of another database dropped: a note in the broker, read by this service.

A worker takes any message on its queue; one for a job its database does not hold (another service's,
sharing the broker) goes back to the queue a few times and is then dropped (worker/tasks.py). That
worker cannot write to the job's database, so the job stayed `queued` for ever (issue 41). It leaves a
note in the broker both services share instead, and the sweeper of this service's workers fails each
queued job that has one, with the note's reason:

- Redis: the key `{BROKER_KEY_PREFIX}dtp-layout:dead-letter:{job id}` (expires after NOTE_TTL_S);
- the embedded SQLite broker: the table `dtp_layout_dead_letters` in the broker's file.

Other brokers carry no note (their workers only log the drop). Torch-free.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, update

from app.core import events
from app.core.broker_owner import sqlite_broker_file
from app.core.db import Database, Job, utcnow
from app.core.settings import Settings

REDIS_KEY = "dtp-layout:dead-letter:"
SQLITE_TABLE = "dtp_layout_dead_letters"
NOTE_TTL_S = 7 * 86400


def _redis(settings: Settings) -> Any:
    import redis

    return redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=5)


def _is_redis(settings: Settings) -> bool:
    return settings.broker_url.startswith(("redis://", "rediss://"))


def _sqlite(path: object) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), timeout=30)
    conn.execute(f"CREATE TABLE IF NOT EXISTS {SQLITE_TABLE} (job_id TEXT PRIMARY KEY, reason TEXT NOT NULL, "
                 "at REAL NOT NULL)")
    return conn


def note(settings: Settings, job_id: str, reason: str) -> bool:
    """Leave the note for the job's own service; False where the broker carries none."""
    reason = reason[:1000]
    if _is_redis(settings):
        client = _redis(settings)
        try:
            client.set(f"{settings.broker_key_prefix or ''}{REDIS_KEY}{job_id}", reason, ex=NOTE_TTL_S)
        finally:
            client.close()
        return True
    path = sqlite_broker_file(settings.broker_url)
    if path is None:
        return False
    conn = _sqlite(path)
    try:
        with conn:
            conn.execute(f"INSERT OR REPLACE INTO {SQLITE_TABLE} (job_id, reason, at) VALUES (?, ?, ?)",
                         (job_id, reason, time.time()))
    finally:
        conn.close()
    return True


def noted(settings: Settings, job_ids: Sequence[str]) -> dict[str, str]:
    """The notes left for any of `job_ids` (job id → reason)."""
    if not job_ids:
        return {}
    if _is_redis(settings):
        client = _redis(settings)
        try:
            values = client.mget([f"{settings.broker_key_prefix or ''}{REDIS_KEY}{j}" for j in job_ids])
        finally:
            client.close()
        return {j: v.decode(errors="replace") for j, v in zip(job_ids, values, strict=True) if v is not None}
    path = sqlite_broker_file(settings.broker_url)
    if path is None or not path.is_file():
        return {}
    conn = _sqlite(path)
    try:
        marks = ",".join("?" * len(job_ids))
        rows = conn.execute(f"SELECT job_id, reason FROM {SQLITE_TABLE} WHERE job_id IN ({marks})", list(job_ids))
        return {str(j): str(r) for j, r in rows}
    finally:
        conn.close()


def fail_dead_lettered(db: Database, settings: Settings) -> list[str]:
    """Fail each queued job nobody holds that a worker of another database dropped, with the reason."""
    with db.session() as session:
        queued = session.scalars(select(Job.id).where(Job.status == "queued", Job.lease_until.is_(None))
                                 .order_by(Job.created_at).limit(500)).all()
    failed = []
    for job_id, reason in noted(settings, list(queued)).items():
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
