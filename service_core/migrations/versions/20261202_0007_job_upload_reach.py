"""jobs.reads_all_uploads: whether a job's run may read every owner's uploads (an admin submitted it).

The run checks its local paths again when it opens them (trainer_core/path_guard.py) and needs the
reach the submit's check allowed. Jobs stored before this revision get ``false``: their runs may read
their owner's uploads only, the rule every non-admin job was submitted under.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reads_all_uploads", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("reads_all_uploads")
