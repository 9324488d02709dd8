"""The writes every component shares: storing a new job, status transitions and appending job events.

Status moves only forward (``can_transition``); a terminal status is never overwritten. Both the API
(cancelling a queued job) and the worker (everything else) go through :func:`transition`.

Fencing: a worker's writes for a job carry the attempt it claimed (``jobs.attempts``, incremented by
each claim) and match only while the job is still ``running`` that attempt (:func:`fence`). A stale
worker (frozen past its lease, its job requeued and claimed again) writes nothing: its UPDATEs match
no row, and its events are refused in the same transaction that would have numbered them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Insert,
    Integer,
    Select,
    Table,
    bindparam,
    exists,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.orm import Session

from service_core.db.base import as_utc, utcnow
from service_core.db.event_notify import notify_new_events
from service_core.db.models import Job, JobEvent, Webhook
from service_core.db.session import allocate_seqs
from service_core.db.totals import count_finish
from service_core.status import ErrorReason, JobStatus, can_transition
from service_core.webhooks import CHECKPOINT_CREATED, owner_wants, record_job_event, status_event_type

QUEUED_EVENT = status_event_type(JobStatus.queued)


class FencedOut(Exception):
    """A worker's write for an attempt of a job that is no longer the current running one."""


def fence(attempt: int) -> tuple[ColumnElement[bool], ...]:
    """The WHERE conditions of a write by the worker running ``attempt``: still running, still that attempt."""
    return (Job.attempts == attempt, Job.status == JobStatus.running.value)


def renew_lease(session: Session, job_id: str, attempt: int, lease_s: float) -> bool:
    """Extend a running job's lease by ``lease_s`` from now; False when ``attempt`` is fenced out."""
    expires = utcnow() + timedelta(seconds=lease_s)
    result = session.execute(update(Job).where(Job.id == job_id, *fence(attempt)).values(lease_expires_at=expires))
    return bool(result.rowcount == 1)  # type: ignore[attr-defined]


def job_row(values: dict[str, Any]) -> dict[str, Any]:
    """A new job's every column: ``values``, and each column not given at its model default, computed
    here, in Python, so the stored job is complete without reading the row back."""
    table: Table = Job.__table__  # type: ignore[assignment]
    row = dict(values)
    for column in table.columns:
        if column.key in row:
            continue
        default = column.default
        if default is None:
            row[column.key] = None
        elif default.is_callable:
            row[column.key] = default.arg(None)  # type: ignore[attr-defined]  # SQLAlchemy wraps f() as f(ctx)
        elif default.is_scalar:
            row[column.key] = default.arg  # type: ignore[attr-defined]
        else:
            raise TypeError(f"jobs.{column.key}: a SQL-side default cannot be computed in Python")
    return row


def insert_job(conn: Connection, **values: Any) -> Job:
    """Store a new job with one INSERT on ``conn``; returns it as a detached ``Job`` with every column set.

    Core rather than the ORM's unit of work, on an autocommit connection: a submit then costs one
    statement and one round trip instead of BEGIN, INSERT and COMMIT through a flush (bench_api.py).
    """
    table: Table = Job.__table__  # type: ignore[assignment]
    row = job_row(values)
    if not owner_wants(conn, row["owner"], QUEUED_EVENT):
        conn.execute(insert(table), row)
    elif conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        # The job and its webhook deliveries commit together: a transaction of their own, only for
        # owners with a webhook that wants the event (everyone else keeps the one-statement submit).
        with conn.engine.begin() as tx:
            tx.execute(insert(table), row)
            record_job_event(tx, row["id"], QUEUED_EVENT, 0, at=row["created_at"])
    else:
        conn.execute(insert(table), row)
        record_job_event(conn, row["id"], QUEUED_EVENT, 0, at=row["created_at"])
    return Job(**row)


def queued_count(owner: str | ColumnElement[str]) -> Select[int]:
    """The number of ``owner``'s jobs waiting in the queue: what ``TRAINJOBS_MAX_QUEUED_PER_OWNER`` bounds."""
    return select(func.count()).select_from(Job).where(Job.owner == owner, Job.status == JobStatus.queued.value)


def insert_plain_job(conn: Connection, queued_limit: int, **values: Any) -> Job | None:
    """A submit's common case in one statement: INSERT the job only while its owner has fewer than
    ``queued_limit`` jobs queued (0: no limit) and no enabled webhook (whose deliveries must commit with
    the job). None, with nothing stored, when either does not hold: the caller then checks the quota
    and stores the job with :func:`insert_job`, one statement at a time.

    Folding the quota's COUNT and the webhook lookup into the INSERT saves two of a submit's five round
    trips (bench/README, "Where a submit's time goes").
    """
    row = job_row(values)
    parameters = {**row, "queued_limit_": queued_limit} if queued_limit > 0 else row
    stored = conn.execute(_plain_insert(queued_limit > 0), parameters).first()
    return Job(**row) if stored is not None else None


@cache
def _plain_insert(limited: bool) -> Insert:
    """:func:`insert_plain_job`'s statement, built once: every value a bound parameter named for its column
    (and ``queued_limit_``). Building it per submit, 40-odd literals and their cache key, took about a
    quarter of a submit's CPU (bench/README, "Where a submit's time goes")."""
    table: Table = Job.__table__  # type: ignore[assignment]
    owner = bindparam("owner", type_=table.c.owner.type)
    guards: list[ColumnElement[bool]] = [~exists().where(Webhook.owner == owner, Webhook.enabled.is_(True))]
    if limited:
        guards.append(queued_count(owner).scalar_subquery() < bindparam("queued_limit_", type_=Integer()))
    columns = list(table.columns)
    source = select(*(bindparam(c.key, type_=c.type).label(c.key) for c in columns)).where(*guards)
    # RETURNING rather than rowcount, which psycopg reports as -1 for an INSERT ... SELECT.
    return insert(table).from_select([c.key for c in columns], source).returning(table.c.id)


def add_events(
    session: Session,
    job_id: str,
    events: Sequence[tuple[str, dict[str, Any], datetime | None]],
    *,
    attempt: int | None = None,
) -> int:
    """Append ``(kind, data, time)`` events with consecutive seqs; returns the last seq (0 if none).

    With ``attempt`` (a worker's fencing token) the events are refused, :class:`FencedOut`, unless that
    attempt is the job's running one; the check is the same UPDATE that numbers them. Open event
    streams of the job are woken when the transaction commits (service_core/db/event_notify.py).
    """
    if not events:
        return 0
    first = allocate_seqs(session, job_id, len(events), *(fence(attempt) if attempt is not None else ()))
    if first is None:
        raise FencedOut(f"job {job_id}: attempt {attempt} is not the running attempt; {len(events)} events refused")
    session.add_all(
        JobEvent(job_id=job_id, seq=first + i, kind=kind, data=data, time=time or utcnow())
        for i, (kind, data, time) in enumerate(events)
    )
    for i, (kind, data, time) in enumerate(events):
        if kind == "checkpoint":  # a complete checkpoint, announced once (worker/checkpoint_sync.py)
            record_job_event(session, job_id, CHECKPOINT_CREATED, first + i, extra={"checkpoint": data}, at=time)
    notify_new_events(session, job_id)
    return first + len(events) - 1


def transition(
    session: Session,
    job_id: str,
    new: JobStatus,
    *,
    reason: ErrorReason | None = None,
    message: str | None = None,
    expect: JobStatus | None = None,
    attempt: int | None = None,
    conditions: Sequence[ColumnElement[bool]] = (),
    **fields: Any,
) -> bool:
    """Move a job to ``new`` if allowed (and if it is still ``expect``, when given).

    A compare-and-set UPDATE, so two processes racing to move the same job cannot both win: the
    loser sees ``False`` and must leave the job alone. Writes a ``status`` event on success. ``reason``
    and ``message`` are stored on the job when ``new`` is terminal, and go on the event either way.
    ``attempt`` is a worker's fencing token: the move happens only while the job's ``attempts`` is
    still that number. ``conditions`` are further WHERE clauses the row must meet at the UPDATE.
    """
    row = session.execute(select(Job.status, Job.attempts, Job.started_at).where(Job.id == job_id)).one_or_none()
    if row is None:
        return False
    current_status = JobStatus(row.status)
    if expect is not None and current_status != expect:
        return False
    if attempt is not None and row.attempts != attempt:
        return False
    if not can_transition(current_status, new):
        return False
    now = utcnow()
    values: dict[str, Any] = {"status": new.value, "updated_at": now, **fields}
    if new == JobStatus.running:
        values.setdefault("started_at", now)
    else:
        values.setdefault("lease_expires_at", None)  # only a running attempt holds a lease
    if current_status == JobStatus.running and row.started_at is not None:
        # An attempt ends (requeued, paused or finished): its time is charged (service_core/usage.py).
        # The compare-and-set below keeps two movers from both adding it.
        values["run_seconds"] = Job.run_seconds + max(0.0, (now - as_utc(row.started_at)).total_seconds())
    if new.terminal:
        values["finished_at"] = now
        if reason is not None:
            values["error_reason"] = reason.value
        if message is not None:
            values["error_message"] = message
    where = [Job.id == job_id, Job.status == current_status.value, *conditions]
    if attempt is not None:
        where.append(Job.attempts == attempt)
    # RETURNING the start the row holds after the move: the run time a finish adds to the totals.
    moved = session.execute(update(Job).where(*where).values(**values).returning(Job.started_at)).one_or_none()
    if moved is None:
        return False
    data: dict[str, Any] = {"status": new.value, "previous": current_status.value}
    if reason is not None:
        data["reason"] = reason.value
    if message is not None:
        data["message"] = message
    seq = add_events(session, job_id, [("status", data, now)])
    # The status event's reason and message: a requeue has them on its event only, not on the row.
    record_job_event(session, job_id, status_event_type(new), seq, extra=data, at=now)
    if new.terminal:
        # Last, so the shared totals rows stay locked for as short a time as the transaction allows.
        count_finish(session, new, moved.started_at, now)
    return True
