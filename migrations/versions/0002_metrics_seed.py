"""metrics: a seed column, one row per (job, layout, seed, step, name)

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-07

Batch operations: SQLite recreates the table (it cannot add a constraint in place); Postgres alters it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

UNIQUE = "uq_metrics_job_layout_seed_step_name"
OLD_INDEX = "ix_metrics_job_layout_name_step"


def upgrade() -> None:
    # Nothing wrote metrics before this revision; should duplicates exist, keep the first of each key.
    op.execute("DELETE FROM metrics WHERE id NOT IN "
               "(SELECT MIN(id) FROM metrics GROUP BY job_id, layout, step, name)")
    with op.batch_alter_table("metrics") as batch:
        batch.add_column(sa.Column("seed", sa.Integer(), nullable=False, server_default="0"))
        batch.drop_index(OLD_INDEX)
        batch.create_unique_constraint(UNIQUE, ["job_id", "layout", "seed", "step", "name"])


def downgrade() -> None:
    with op.batch_alter_table("metrics") as batch:
        batch.drop_constraint(UNIQUE, type_="unique")
        batch.create_index(OLD_INDEX, ["job_id", "layout", "name", "step"])
        batch.drop_column("seed")
