"""jobs.pause_requested: a running job's pause, for its slot to carry out (the `paused` status).

``status`` is a plain string column, so the new status needs no change of its own.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04 17:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pause_requested", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    # A paused job has no status before this revision: it goes back to the queue (it resumes from its checkpoint).
    op.execute("UPDATE jobs SET status = 'queued' WHERE status = 'paused'")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("pause_requested")
