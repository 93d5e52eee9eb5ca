"""Every byte owned and counted: uploads.charged / completing_at, jobs.reserved_bytes, derived_data and
derived_needs

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

`uploads.charged`: the bytes an upload counts against its tenant's quota (each declared file at least
DTP_LAYOUT_UPLOAD_MIN_FILE_BYTES; existing rows: their declared size). `uploads.completing_at`: set while
one `complete` call assembles the upload (a second call is 409). `jobs.reserved_bytes`: the artifact
bytes a queued or running job holds against the quota (estimated at submit, raised by the worker before
it publishes more). `derived_data`: data made from a tenant's upload or job (a converted model, an
affinity cache entry) with its store prefix and bytes; `derived_needs`: which uploads and jobs need
it (`upload:<id>` / `job:<id>`): the entry goes when the last of them does.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.add_column(sa.Column("charged", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("completing_at", sa.DateTime(), nullable=True))
    op.execute("UPDATE uploads SET charged = size")
    op.create_index("ix_uploads_owner_status", "uploads", ["owner", "status"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("reserved_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_table(
        "derived_data",
        sa.Column("id", BigId, primary_key=True, autoincrement=True),
        sa.Column("owner", sa.String(100), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("prefix", sa.String(300), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("prefix", name="uq_derived_data_prefix"),
    )
    op.create_index("ix_derived_data_owner", "derived_data", ["owner"])
    op.create_table(
        "derived_needs",
        sa.Column("derived_id", BigId, sa.ForeignKey("derived_data.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("needer", sa.String(40), primary_key=True),
    )
    op.create_index("ix_derived_needs_needer", "derived_needs", ["needer"])


def downgrade() -> None:
    op.drop_index("ix_derived_needs_needer", table_name="derived_needs")
    op.drop_table("derived_needs")
    op.drop_index("ix_derived_data_owner", table_name="derived_data")
    op.drop_table("derived_data")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("reserved_bytes")
    op.drop_index("ix_uploads_owner_status", table_name="uploads")
    with op.batch_alter_table("uploads") as batch:
        batch.drop_column("completing_at")
        batch.drop_column("charged")
