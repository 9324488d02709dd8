"""jobs.run_seconds, jobs.devices, jobs.price_per_device_hour: what a job is charged (service_core/usage.py).

``run_seconds`` adds up every attempt's time in ``running`` (``started_at`` is the last attempt's
start only). Jobs stored before this revision are charged their last attempt, the only one on record.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 22:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("run_seconds", sa.Float(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("devices", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("price_per_device_hour", sa.Float(), nullable=True))
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String),
        sa.column("started_at", sa.DateTime(timezone=True)),
        sa.column("finished_at", sa.DateTime(timezone=True)),
        sa.column("run_seconds", sa.Float),
    )
    # Portable backfill (no date arithmetic in SQL that both SQLite and PostgreSQL read the same way).
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(jobs.c.id, jobs.c.started_at, jobs.c.finished_at).where(
            jobs.c.started_at.is_not(None), jobs.c.finished_at.is_not(None)
        )
    ).all()
    for job_id, started, finished in rows:
        seconds = max(0.0, (finished - started).total_seconds())
        bind.execute(sa.update(jobs).where(jobs.c.id == job_id).values(run_seconds=seconds))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("price_per_device_hour")
        batch_op.drop_column("devices")
        batch_op.drop_column("run_seconds")
