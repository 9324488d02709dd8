"""jobs.auto_choices (the values `auto` chose at submit, and why); workers.device_memory_gb and
workers.device_kind (what each worker reports for its device: the `auto` micro-batch's budget).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04 17:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# JSONB on PostgreSQL, JSON text elsewhere (service_core.db.base.JsonType).
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("auto_choices", JSON_TYPE, nullable=True))
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("device_memory_gb", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("device_kind", sa.String(length=8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("device_kind")
        batch_op.drop_column("device_memory_gb")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("auto_choices")
