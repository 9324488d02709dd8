"""The per-owner cap on running jobs (``TRAINJOBS_MAX_RUNNING_PER_OWNER``), enforced where jobs start.

A slot claims a job with a compare-and-set ``queued -> running`` (worker/execute.py). With a cap, the
same transaction then counts the owner's other running jobs; at the cap it rolls back, and the job
stays ``queued``, held: ``waiting_reason`` says why (the API shows it) and ``enqueued_at`` is NULL (the
outbox's "not sent" mark). Its message is consumed, so it holds no slot and other owners' jobs go
ahead. When a run ends, its slot re-sends held jobs of owners now below the cap
(:func:`resend_waiting`); the sweep does the same each round, for a slot that died before it could.
Only as many of an owner's held jobs as it has free places are sent, so a long backlog is not
re-sent (and refused again) on every round.

The count is race-safe across slots: on PostgreSQL a transaction-scoped advisory lock per owner
serialises the claims of one owner, so each count sees the claims committed before it; on SQLite the
claim's UPDATE takes the database's single write lock before the count, with the same effect.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from sqlalchemy import func, select, text, update
from sqlalchemy.orm import Session

from service_core.db.base import utcnow
from service_core.db.models import Job
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import JobStatus

log = logging.getLogger(__name__)

# The advisory-lock namespace of owners' claims (the first key of pg_advisory_xact_lock(int, int)).
CLAIM_LOCK_NAMESPACE = 0x74_6A_72  # "tjr"


def lock_owner_claims(session: Session, job_id: str) -> str | None:
    """The job's owner (None: no such job), with this transaction holding the owner's claim lock."""
    owner = session.execute(select(Job.owner).where(Job.id == job_id)).scalar_one_or_none()
    if owner is not None and session.get_bind().dialect.name == "postgresql":
        # hashtext collisions only make two owners' claims wait for each other, never miscount.
        session.execute(
            text("SELECT pg_advisory_xact_lock(:ns, hashtext(:owner))"), {"ns": CLAIM_LOCK_NAMESPACE, "owner": owner}
        )
    return owner


def running_count(session: Session, owner: str, *, excluding: str | None = None) -> int:
    where = [Job.owner == owner, Job.status == JobStatus.running.value]
    if excluding is not None:
        where.append(Job.id != excluding)
    return int(session.execute(select(func.count()).select_from(Job).where(*where)).scalar_one())


def waiting_message(owner: str, running: int, cap: int) -> str:
    return (
        f"waiting: {owner} already has {running} running jobs, the most allowed "
        f"(TRAINJOBS_MAX_RUNNING_PER_OWNER={cap}); it starts when one of them ends"
    )


def hold(session: Session, job_id: str, message: str) -> None:
    """Leave the (still queued) job unsent and say why; the caller's transaction commits it."""
    session.execute(
        update(Job)
        .where(Job.id == job_id, Job.status == JobStatus.queued.value)
        .values(waiting_reason=message, enqueued_at=None)
    )


def owners_below_cap(session: Session, owners: Collection[str], cap: int) -> dict[str, int]:
    """Of ``owners``, those with free places under ``cap``, and how many each has."""
    rows = session.execute(
        select(Job.owner, func.count())
        .where(Job.owner.in_(list(owners)), Job.status == JobStatus.running.value)
        .group_by(Job.owner)
    ).tuples()
    counts = {owner: int(n) for owner, n in rows}
    return {owner: cap - counts.get(owner, 0) for owner in owners if counts.get(owner, 0) < cap}


def resend_waiting(settings: Settings, queues: Collection[str] | None = None) -> list[str]:
    """Send the held jobs of owners below the cap again (at most their free places); returns their ids.

    ``queues``: only jobs of these queues (the sweep passes the queues live workers consume).
    """
    from service_core.queue import send_once

    cap = settings.max_running_per_owner
    # Multi-node jobs held for want of workers are worker/gang.py's.
    held = (Job.status == JobStatus.queued.value, Job.waiting_reason.is_not(None), Job.enqueued_at.is_(None),
            Job.nodes <= 1)  # fmt: skip
    picked: list[tuple[str, str, int]] = []
    with session_scope(settings.database_url) as session:
        where = [*held] if queues is None else [*held, Job.queue.in_(sorted(queues))]
        owners = session.execute(select(Job.owner).where(*where).distinct()).scalars().all()
        # No cap (any more): every held job goes.
        free = owners_below_cap(session, owners, cap) if cap > 0 else dict.fromkeys(owners, 0)
        for owner, places in free.items():
            rows = session.execute(
                select(Job.id, Job.queue, Job.priority).where(*where, Job.owner == owner)
                .order_by(Job.priority.desc(), Job.created_at).limit(places if cap > 0 else None)
            ).tuples()  # fmt: skip
            picked.extend(rows)
    # Compare-and-set on the hold: a slot and the sweep never both send a job.
    sent = [
        job_id
        for job_id, queue, priority in picked
        if send_once(settings, job_id, queue, priority, held, {"enqueued_at": utcnow(), "waiting_reason": None})
    ]
    if sent:
        log.info("sent %d jobs held by the running-jobs cap again: %s", len(sent), sent)
    return sent
