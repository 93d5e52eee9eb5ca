"""job_events: a job's events in their own table (appended, never rewritten); jobs.history dropped

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-14

Each entry of every job's `history` array becomes a row, in the array's order: `event` → kind, `at`
→ at (the job's created_at where missing or unreadable), and the facts read back (stage, attempt,
device, request_id, reason, seconds) into their columns; every other key goes to `detail`. Entries
that are not objects are dropped. Downgrade rebuilds the arrays from the rows (the columns merged back
into each entry). Batch operations: SQLite recreates `jobs` to drop the column; Postgres alters it.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
NullableJSON = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
BATCH = 1000  # rows per INSERT: far below either database's bind-parameter limit

# Column → (the longest it holds, the Python type it must be); longer or other values stay in `detail`.
_TEXT_COLUMNS = {"stage": 32, "request_id": 200}

jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("created_at", sa.DateTime),
                sa.column("history", JSONType))
job_events = sa.table("job_events", sa.column("id", BigId), sa.column("job_id", sa.String),
                      sa.column("at", sa.DateTime), sa.column("kind", sa.String), sa.column("stage", sa.String),
                      sa.column("attempt", sa.Integer), sa.column("device", NullableJSON),
                      sa.column("request_id", sa.String), sa.column("reason", sa.Text),
                      sa.column("seconds", sa.Float), sa.column("detail", JSONType))


def _at(value: Any, fallback: datetime) -> datetime:
    if isinstance(value, str):
        try:
            stamp = datetime.fromisoformat(value.removesuffix("Z"))
        except ValueError:
            return fallback
        return stamp if stamp.tzinfo is None else stamp.astimezone(UTC).replace(tzinfo=None)
    return fallback


def event_row(job_id: str, entry: dict[str, Any], created_at: datetime) -> dict[str, Any]:
    """One history entry as a job_events row."""
    detail = {k: v for k, v in entry.items() if k not in ("event", "at")}
    row: dict[str, Any] = {"job_id": job_id, "at": _at(entry.get("at"), created_at),
                           "kind": str(entry.get("event") or "unknown")[:32]}
    for column, longest in _TEXT_COLUMNS.items():
        value = detail.get(column)
        row[column] = detail.pop(column) if isinstance(value, str) and len(value) <= longest else None
    attempt = detail.get("attempt")
    row["attempt"] = detail.pop("attempt") if isinstance(attempt, int) and not isinstance(attempt, bool) else None
    row["device"] = detail.pop("device") if isinstance(detail.get("device"), dict) else None
    row["reason"] = detail.pop("reason") if isinstance(detail.get("reason"), str) else None
    seconds = detail.get("seconds")
    row["seconds"] = float(detail.pop("seconds")) if isinstance(seconds, int | float) \
        and not isinstance(seconds, bool) else None
    row["detail"] = {k: v for k, v in detail.items() if v is not None}
    return row


def _history_rows(conn: sa.Connection) -> Iterator[list[dict[str, Any]]]:
    """The events of the jobs' histories, a page of jobs at a time (keyset by id: no cursor stays open
    while the rows are written, and memory holds one page)."""
    last = ""
    while True:
        page = conn.execute(sa.select(jobs.c.id, jobs.c.created_at, jobs.c.history).where(jobs.c.id > last)
                            .order_by(jobs.c.id).limit(BATCH // 10)).all()
        if not page:
            return
        rows = []
        for job_id, created_at, history in page:
            fallback = created_at if isinstance(created_at, datetime) else datetime(1970, 1, 1)
            rows += [event_row(job_id, entry, fallback) for entry in (history if isinstance(history, list) else [])
                     if isinstance(entry, dict)]
        yield rows
        last = page[-1][0]


def upgrade() -> None:
    op.create_table(
        "job_events",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("at", sa.DateTime(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("stage", sa.String(32), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("device", NullableJSON, nullable=True),
        sa.Column("request_id", sa.String(200), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("detail", JSONType, nullable=False),
    )
    op.create_index("ix_job_events_job_id_id", "job_events", ["job_id", "id"])
    conn = op.get_bind()
    for rows in _history_rows(conn):
        for i in range(0, len(rows), BATCH):
            conn.execute(job_events.insert(), rows[i:i + BATCH])
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("history")


def history_entry(row: Any) -> dict[str, Any]:
    """A job_events row back as a history entry."""
    entry: dict[str, Any] = {"at": row.at.isoformat() + "Z", "event": row.kind, **(row.detail or {})}
    for column in ("stage", "attempt", "device", "request_id", "reason", "seconds"):
        value = getattr(row, column)
        if value is not None:
            entry[column] = value
    return entry


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("history", JSONType, nullable=True))
    conn = op.get_bind()
    histories: dict[str, list[dict[str, Any]]] = {}
    for row in conn.execute(sa.select(job_events).order_by(job_events.c.job_id, job_events.c.id)).all():
        histories.setdefault(row.job_id, []).append(history_entry(row))
    update = jobs.update().where(jobs.c.id == sa.bindparam("job")).values(history=sa.bindparam("entries"))
    items = [{"job": job_id, "entries": entries} for job_id, entries in histories.items()]
    for i in range(0, len(items), BATCH):
        conn.execute(update, items[i:i + BATCH])
    conn.execute(jobs.update().where(jobs.c.history.is_(None)).values(history=[]))
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("history", existing_type=JSONType, nullable=False)
    op.drop_index("ix_job_events_job_id_id", table_name="job_events")
    op.drop_table("job_events")
