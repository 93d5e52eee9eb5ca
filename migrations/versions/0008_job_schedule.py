"""jobs.schedule: the schedule a job runs, canonical, in a column of its own; jobs.delta dropped

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

Until now a job's row held δ alone, so a `dtp:1` job and a `pt:2` job of one model were the same to a
filter (issue 43). Each existing row gets the schedule its stored spec runs, in canonical form: the spec's
`schedule` parsed by the schedule grammar (`spd:3,1` → `spd:1,3`), or, where the spec gives none (its
shorthand), `dtp:δ` of the row's δ. δ is no column any more: it is read from the schedule (a dtp schedule's
δ) or, for the other schedules, from the spec (the δ the layouts were built for; app.core.db.Job.delta).

The grammar is the live `models.schedules.grammar` (torch-free): the canonical form is the grammar's.
A stored schedule it cannot parse (written by a grammar that has since changed) is kept as it was, cut to
the column's length: it then matches no canonical filter, and the row still says what the job ran.
Downgrade puts δ back: the spec's `delta`, else the schedule's δ, else 1. Batch operations: SQLite
recreates `jobs`; Postgres alters it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from models.schedules.grammar import MAX_SCHEDULE_CHARS, ScheduleError, dtp_spec, parse_schedule

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
PAGE = 1000  # jobs read per query: memory holds one page

jobs = sa.table("jobs", sa.column("id", sa.String), sa.column("spec", JSONType), sa.column("delta", sa.Integer),
                sa.column("schedule", sa.String))


def stored_schedule(spec: Any, delta: int) -> str:
    """The schedule a stored spec runs, canonical: its `schedule`, else dtp:δ of the row's δ."""
    text = spec.get("schedule") if isinstance(spec, dict) else None
    if not isinstance(text, str):
        try:
            return str(dtp_spec(delta))
        except ScheduleError:  # a δ no spec could have held (the API bounds it to 0 .. 1024)
            return f"dtp:{delta}"
    try:
        return str(parse_schedule(text))
    except ScheduleError:
        return text[:MAX_SCHEDULE_CHARS]


def stored_delta(spec: Any, schedule: str | None) -> int:
    """δ as the dropped column held it (the spec's `delta`), for a downgrade."""
    delta = spec.get("delta") if isinstance(spec, dict) else None
    if isinstance(delta, int) and not isinstance(delta, bool):
        return delta
    try:
        parsed = parse_schedule(schedule or "")
    except ScheduleError:
        return 1
    return parsed.delta if parsed.kind == "dtp" else 1


def _pages(conn: sa.Connection, *columns: sa.ColumnClause[Any]) -> Iterator[list[sa.Row[Any]]]:
    """The jobs' rows, a page at a time (keyset by id: no cursor stays open while the rows are written)."""
    last = ""
    while True:
        page = conn.execute(sa.select(jobs.c.id, *columns).where(jobs.c.id > last)
                            .order_by(jobs.c.id).limit(PAGE)).all()
        if not page:
            return
        yield list(page)
        last = page[-1].id


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("schedule", sa.String(MAX_SCHEDULE_CHARS), nullable=True))
    conn = op.get_bind()
    update = jobs.update().where(jobs.c.id == sa.bindparam("job_id")).values(schedule=sa.bindparam("value"))
    for page in _pages(conn, jobs.c.spec, jobs.c.delta):
        conn.execute(update, [{"job_id": row.id, "value": stored_schedule(row.spec, row.delta)} for row in page])
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("schedule", existing_type=sa.String(MAX_SCHEDULE_CHARS), nullable=False)
        batch.drop_column("delta")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("delta", sa.Integer(), nullable=True))
    conn = op.get_bind()
    update = jobs.update().where(jobs.c.id == sa.bindparam("job_id")).values(delta=sa.bindparam("value"))
    for page in _pages(conn, jobs.c.spec, jobs.c.schedule):
        conn.execute(update, [{"job_id": row.id, "value": stored_delta(row.spec, row.schedule)} for row in page])
    with op.batch_alter_table("jobs") as batch:
        batch.alter_column("delta", existing_type=sa.Integer(), nullable=False)
        batch.drop_column("schedule")
