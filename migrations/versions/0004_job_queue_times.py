"""jobs: enqueued_at (when the job's message was last sent, by the database clock) and requeues (how
many times a sweeper sent it again)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30

Batch operations: SQLite recreates the table; Postgres alters it. Existing queued jobs get
enqueued_at = created_at, so the queued sweeper treats them by their age.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("enqueued_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("requeues", sa.Integer(), nullable=False, server_default="0"))
    op.execute("UPDATE jobs SET enqueued_at = created_at WHERE status = 'queued'")
    op.create_index("ix_jobs_status_enqueued_at", "jobs", ["status", "enqueued_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_status_enqueued_at", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("requeues")
        batch.drop_column("enqueued_at")
