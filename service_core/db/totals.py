"""Running totals over every job that ever finished: the Prometheus counters behind ``GET /metrics``.

A scrape must not read the whole history (100,000 jobs cost two full scans of ``jobs``), and a counter
must never go down, not even when ``trainjobs gc`` deletes old jobs. So each move to a terminal status
adds to a few rows of ``job_totals`` in the transaction that makes the move (:func:`count_finish`,
called by ``jobstore.transition``), and the scrape reads those rows. Retention deletes jobs and never
touches the totals. Queued and running jobs are gauges and are counted live (few rows, by index).

Keys: ``finished:<status>`` (jobs that ended in that status), ``duration_sum`` (seconds from start to
end, over the jobs that started) and ``duration_bucket:<le>`` (how many runs fell in that bucket only,
not cumulative: one row per finish to update; the scrape accumulates them in bound order).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from service_core.db.base import as_utc
from service_core.db.models import JobTotal
from service_core.status import JobStatus

# Upper bounds (seconds) of the run-time histogram; the last bucket, +Inf, takes the rest.
DURATION_BUCKETS = (10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0, 24 * 3600.0, 72 * 3600.0)
INF_LABEL = "+Inf"
DURATION_SUM = "duration_sum"


def finished_key(status: JobStatus) -> str:
    return f"finished:{status.value}"


def bucket_label(bound: float) -> str:
    """The ``le`` label Prometheus clients write for ``bound`` (``repr``: 10.0, 14400.0)."""
    return repr(bound)


def bucket_key(label: str) -> str:
    return f"duration_bucket:{label}"


def duration_bucket(seconds: float) -> str:
    """The label of the one bucket ``seconds`` falls in (the smallest bound at or above it)."""
    for bound in DURATION_BUCKETS:
        if seconds <= bound:
            return bucket_label(bound)
    return INF_LABEL


def count_finish(session: Session, status: JobStatus, started_at: datetime | None, finished_at: datetime) -> None:
    """Add one job that just reached terminal ``status`` to the totals, in the caller's transaction.

    One upsert statement; its keys go in sorted order so two finishing jobs lock the shared rows in
    the same order (no deadlock between them). A job that never started (cancelled while queued)
    counts as finished but has no run time.
    """
    increments: dict[str, float] = {finished_key(status): 1.0}
    if started_at is not None:
        seconds = max(0.0, (finished_at - as_utc(started_at)).total_seconds())
        increments[DURATION_SUM] = seconds
        increments[bucket_key(duration_bucket(seconds))] = 1.0
    add_to_totals(session, increments)


def add_to_totals(session: Session, increments: dict[str, float]) -> None:
    """``value += increment`` for each key, creating missing rows (PostgreSQL and SQLite upsert)."""
    insert: Any = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    statement = insert(JobTotal).values([{"key": key, "value": increments[key]} for key in sorted(increments)])
    statement = statement.on_conflict_do_update(
        index_elements=[JobTotal.key], set_={"value": JobTotal.value + statement.excluded.value}
    )
    session.execute(statement)


def read_totals(session: Session) -> dict[str, float]:
    """Every running total by key (a few dozen rows at most, whatever the history)."""
    return {key: float(value) for key, value in session.execute(select(JobTotal.key, JobTotal.value)).tuples()}
