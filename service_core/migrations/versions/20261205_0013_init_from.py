"""jobs.init_from_job: the job whose checkpoint a job started from (spec `init_from`), indexed for that
job's list of the jobs continued from it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05 08:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("init_from_job", sa.String(length=32), nullable=True))
        batch_op.create_index("ix_jobs_init_from_job", ["init_from_job"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_init_from_job")
        batch_op.drop_column("init_from_job")
