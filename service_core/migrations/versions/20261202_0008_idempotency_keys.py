"""idempotency_keys: the first answer to each submit that carried an ``Idempotency-Key`` (api/idempotency.py).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 09:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# JSONB on PostgreSQL, JSON text elsewhere (service_core.db.base.JsonType).
JSON_TYPE = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("key", sa.String(length=255), nullable=False),
        sa.Column("fingerprint", sa.String(length=64), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=False),
        sa.Column("response", JSON_TYPE, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("owner", "key", name=op.f("pk_idempotency_keys")),
    )
    op.create_index("ix_idempotency_keys_owner_created", "idempotency_keys", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_owner_created", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
