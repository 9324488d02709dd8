"""Running totals of finished jobs (``job_totals``), so a Prometheus scrape does not scan the history.

The table is filled once here from the jobs already stored (one pass over them, at upgrade time);
from then on ``service_core.db.jobstore.transition`` adds each finish in its own transaction. Jobs
that ``trainjobs gc`` removed before this upgrade are not counted: the counters start from what the
database still holds. The bucket bounds and key names are frozen copies of
``service_core.db.totals`` as of this revision.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 04:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TERMINAL = ("cancelled", "failed", "succeeded")
DURATION_BUCKETS = (10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0, 72 * 3600.0)


def upgrade() -> None:
    totals = op.create_table(
        "job_totals",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_job_totals")),
    )
    op.bulk_insert(totals, [{"key": key, "value": value} for key, value in sorted(existing_totals().items())])


def existing_totals() -> dict[str, float]:
    """The totals of the finished jobs stored now (the same keys the running code maintains)."""
    conn = op.get_bind()
    terminal = ", ".join(f"'{status}'" for status in TERMINAL)
    out: dict[str, float] = {}
    for status, count in conn.execute(
        sa.text(f"SELECT status, count(*) FROM jobs WHERE status IN ({terminal}) GROUP BY status")
    ):
        out[f"finished:{status}"] = float(count)
    if conn.dialect.name == "sqlite":
        seconds = "(julianday(finished_at) - julianday(started_at)) * 86400.0"
    else:
        seconds = "extract(epoch FROM finished_at - started_at)"
    buckets = " ".join(f"WHEN {seconds} <= {bound!r} THEN '{bound!r}'" for bound in DURATION_BUCKETS)
    runs = sa.text(
        f"SELECT CASE {buckets} ELSE '+Inf' END AS le, count(*), sum({seconds}) FROM jobs "
        f"WHERE status IN ({terminal}) AND started_at IS NOT NULL AND finished_at IS NOT NULL GROUP BY le"
    )
    duration_sum = 0.0
    for label, count, total in conn.execute(runs):
        out[f"duration_bucket:{label}"] = float(count)
        duration_sum += max(0.0, float(total or 0.0))
    if duration_sum:
        out["duration_sum"] = duration_sum
    return out


def downgrade() -> None:
    op.drop_table("job_totals")
