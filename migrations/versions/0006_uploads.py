"""uploads, upload_files, upload_parts: tenants' own models and data; jobs.expired_at / expired_reason

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02

An upload is declared with its files (path, size, sha256), sent part by part (each part's row records
that it arrived whole) and completed once every file's sha256 matched. `jobs.expired_at` marks a job
whose artifacts were removed from the store (DELETE /v1/jobs/{id}, or the retention sweep);
`expired_reason` says which. Batch operations: SQLite recreates `jobs`; Postgres alters it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

NullableJSON = sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def upgrade() -> None:
    op.create_table(
        "uploads",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("owner", sa.String(100), nullable=True),
        sa.Column("kind", sa.String(8), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("part_size", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("storage_prefix", sa.String(200), nullable=False),
        sa.Column("config", NullableJSON, nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("completed_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_uploads_owner", "uploads", ["owner"])
    op.create_table(
        "upload_files",
        sa.Column("upload_id", sa.String(32), sa.ForeignKey("uploads.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("index", sa.Integer(), primary_key=True),
        sa.Column("path", sa.String(255), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("multipart", sa.String(1024), nullable=True),
        sa.Column("done", sa.Boolean(), nullable=False),
    )
    op.create_table(
        "upload_parts",
        sa.Column("upload_id", sa.String(32), sa.ForeignKey("uploads.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("file_index", sa.Integer(), primary_key=True),
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("etag", sa.String(200), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("expired_at", sa.DateTime(), nullable=True))
        batch.add_column(sa.Column("expired_reason", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("expired_reason")
        batch.drop_column("expired_at")
    op.drop_table("upload_parts")
    op.drop_table("upload_files")
    op.drop_index("ix_uploads_owner", table_name="uploads")
    op.drop_table("uploads")
