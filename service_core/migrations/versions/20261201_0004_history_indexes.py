"""Indexes for a long history: the admin job list across owners, and retention by finish time.

``ix_jobs_created`` (created_at, id) serves ``GET /v1/jobs`` for an admin key (no owner filter), newest
first with keyset pages, without sorting every job; ``ix_jobs_finished`` lets ``trainjobs gc`` find
finished jobs older than a cutoff without scanning them all.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 01:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_created", ["created_at", "id"], unique=False)
        batch_op.create_index("ix_jobs_finished", ["finished_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_finished")
        batch_op.drop_index("ix_jobs_created")
