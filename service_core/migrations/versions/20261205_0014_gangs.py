"""Multi-node jobs: jobs.nodes (resources.num_nodes), workers.address (where the other nodes reach a
worker's), and job_nodes, the worker slots of a job's gang (worker/gang.py), each with its own lease.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 19:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("nodes", sa.Integer(), server_default="1", nullable=False))
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("address", sa.String(length=256), nullable=True))
    op.create_table(
        "job_nodes",
        sa.Column("job_id", sa.String(length=32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("slot", sa.String(length=256), nullable=False),
        sa.Column("worker", sa.String(length=256), nullable=False),
        sa.Column("host", sa.String(length=256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("address", sa.String(length=256), nullable=False),
        sa.Column("port", sa.Integer(), nullable=False),
        sa.Column("node", sa.Integer(), nullable=True),
        sa.Column("joined_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "slot"),
    )


def downgrade() -> None:
    op.drop_table("job_nodes")
    with op.batch_alter_table("workers", schema=None) as batch_op:
        batch_op.drop_column("address")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("nodes")
