"""jobs, layouts, artifacts, metrics

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("owner", sa.String(100), nullable=True),
        sa.Column("spec", JSONType, nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("model_id", sa.String(300), nullable=False),
        sa.Column("revision", sa.String(128), nullable=True),
        sa.Column("devices", sa.Integer(), nullable=False),
        sa.Column("delta", sa.Integer(), nullable=False),
        sa.Column("score", sa.String(8), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("stage", sa.String(16), nullable=True),
        sa.Column("progress", sa.Float(), nullable=False),
        sa.Column("eta_s", sa.Float(), nullable=True),
        sa.Column("stage_started_at", sa.DateTime(), nullable=True),
        sa.Column("stages_done", JSONType, nullable=False),
        sa.Column("timings", JSONType, nullable=False),
        sa.Column("history", JSONType, nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("error_stage", sa.String(16), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("affinity_cached", sa.Boolean(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("lease_until", sa.DateTime(), nullable=True),
        sa.Column("summary", JSONType, nullable=True),
    )
    for column in ("created_at", "owner", "fingerprint", "model_id", "status"):
        op.create_index(f"ix_jobs_{column}", "jobs", [column])

    op.create_table(
        "layouts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("J", sa.Float(), nullable=False),
        sa.Column("random_expectation", sa.Float(), nullable=False),
        sa.Column("upper_bound", sa.Float(), nullable=False),
        sa.Column("upper_bound_exact", sa.Boolean(), nullable=False),
        sa.Column("up_fraction", JSONType, nullable=False),
        sa.Column("down_fraction", JSONType, nullable=False),
        sa.Column("kv_group_device", JSONType, nullable=False),
        sa.Column("neuron_device", JSONType, nullable=False),
        sa.Column("shape", JSONType, nullable=False),
        sa.Column("score", JSONType, nullable=True),
        sa.UniqueConstraint("job_id", "name", name="uq_layouts_job_name"),
    )
    op.create_index("ix_layouts_job_id", "layouts", ["job_id"])

    op.create_table(
        "artifacts",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("storage_key", sa.String(512), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("job_id", "name", name="uq_artifacts_job_name"),
    )
    op.create_index("ix_artifacts_job_id", "artifacts", ["job_id"])

    op.create_table(
        "metrics",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("layout", sa.String(64), nullable=True),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_metrics_job_layout_name_step", "metrics", ["job_id", "layout", "name", "step"])


def downgrade() -> None:
    op.drop_index("ix_metrics_job_layout_name_step", table_name="metrics")
    op.drop_table("metrics")
    op.drop_index("ix_artifacts_job_id", table_name="artifacts")
    op.drop_table("artifacts")
    op.drop_index("ix_layouts_job_id", table_name="layouts")
    op.drop_table("layouts")
    for column in ("status", "model_id", "fingerprint", "owner", "created_at"):
        op.drop_index(f"ix_jobs_{column}", table_name="jobs")
    op.drop_table("jobs")
