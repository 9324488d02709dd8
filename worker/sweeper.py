"""The periodic sweep every worker runs (one at a time), and the worker heartbeat rows it reads.

Every ``TRAINJOBS_SWEEP_SECONDS`` each worker's main process tries to take the ``sweeper`` lease (a row
in ``leases``: an UPDATE that succeeds when the lease is free, expired or already ours, or the INSERT
of the first one; the same on SQLite and PostgreSQL). The holder:

1. requeues or fails running jobs whose heartbeat lease ran out (worker/recovery.py), so a job of a
   lost host runs again within about lease + sweep interval while any worker lives;
2. re-sends queue messages that look lost (the job row is its own outbox record, ``enqueued_at``):
   a queued job that was never sent, older than ``TRAINJOBS_REDELIVER_AFTER_SECONDS``, whose queue a
   live worker consumes; and a sent one older than that bound while a slot of its queue has been idle
   for two heartbeats (an idle slot with prefetch 1 would have taken its message, so it is gone: a
   crash between INSERT and send, a SIGKILLed slot on the embedded broker, a Redis without
   persistence). At most one job per idle slot, so a long queue gets no pile of duplicates; the claim
   ignores the duplicates there are.
3. sends jobs held back by the per-owner running-jobs cap again, for owners with free places
   (worker/running_cap.py; a slot whose run ends does it at once, this is for one that died first);
4. sends multi-node jobs whose gang did not form again, once enough workers of their queue have a free
   slot (worker/gang.py).

Each worker also writes its own row in ``workers`` every ``TRAINJOBS_LEASE_RENEW_SECONDS``: its
queues, slots, how many run a job, and since when one has been idle.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, or_, select, update
from sqlalchemy.exc import IntegrityError

from service_core.db.base import utcnow
from service_core.db.models import Job, Lease, WorkerHeartbeat, live_workers
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import JobStatus
from trainer_core.auto import Budget, device_budget
from worker.gang import advertise_address, busy_slot_pids, resend_gangs
from worker.paths import host_name
from worker.recovery import recover_orphaned_jobs
from worker.running_cap import resend_waiting

log = logging.getLogger(__name__)

SWEEPER_LEASE = "sweeper"


def take_lease(settings: Settings, name: str, holder: str, ttl_s: float) -> bool:
    """Take (or keep) lease ``name`` for ``ttl_s`` seconds; False while someone else holds it."""
    now = utcnow()
    values: dict[str, Any] = {"holder": holder, "expires_at": now + timedelta(seconds=ttl_s)}
    with session_scope(settings.database_url) as session:
        mine = or_(Lease.holder == holder, Lease.expires_at < now)
        result = session.execute(update(Lease).where(Lease.name == name, mine).values(**values))
        if result.rowcount == 1:  # type: ignore[attr-defined]
            return True
    try:
        with session_scope(settings.database_url) as session:
            session.add(Lease(name=name, **values))
    except IntegrityError:  # it exists and is someone else's
        return False
    return True


def release_lease(settings: Settings, name: str, holder: str) -> None:
    with session_scope(settings.database_url) as session:
        session.execute(delete(Lease).where(Lease.name == name, Lease.holder == holder))


def beat(
    settings: Settings, name: str, queues: Sequence[str], slot_pids: Sequence[int], device: Budget | None = None,
    address: str | None = None,
) -> None:
    """Write this worker's heartbeat row: queues, slots, busy slots (a slot in a gang too), since when one
    is idle, its device and its advertised address."""
    now = utcnow()
    with session_scope(settings.database_url) as session:
        running = session.execute(
            select(Job.pid)
            .where(Job.status == JobStatus.running.value, Job.worker == host_name(), Job.pid.in_(list(slot_pids)))
        ).scalars()  # fmt: skip
        # A slot in a gang, forming or running, is busy too.
        busy = len(set(running) | busy_slot_pids(session, host_name(), slot_pids))
        row = session.get(WorkerHeartbeat, name)
        idle_since = None if busy >= len(slot_pids) else (row.idle_since if row and row.idle_since else now)
        values: dict[str, Any] = {"queues": list(queues), "slots": len(slot_pids), "busy": int(busy),
                                  "idle_since": idle_since, "heartbeat_at": now, "address": address}  # fmt: skip
        if device is not None:
            values.update(device_memory_gb=device.gb, device_kind="cpu" if device.cpu else "gpu")
        if row is None:
            session.add(WorkerHeartbeat(name=name, **values))
        else:
            session.execute(update(WorkerHeartbeat).where(WorkerHeartbeat.name == name).values(**values))


def forget_worker(settings: Settings, name: str) -> None:
    with session_scope(settings.database_url) as session:
        session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.name == name))


def idle_slots_by_queue(settings: Settings, now: datetime) -> tuple[set[str], Counter[str]]:
    """Queues some live worker consumes, and per queue the slots idle for two heartbeats or more."""
    idle_before = now - timedelta(seconds=2 * settings.lease_renew_seconds)
    with session_scope(settings.database_url) as session:
        # Rows of workers gone for good go (a stopping worker deletes its own).
        session.execute(delete(WorkerHeartbeat).where(WorkerHeartbeat.heartbeat_at < now - timedelta(hours=1)))
        workers = live_workers(session, settings.lease_seconds, now=now)
        served: set[str] = set()
        idle: Counter[str] = Counter()
        for worker in workers:
            served.update(worker.queues)
            if worker.idle_since is not None and _aware(worker.idle_since) <= idle_before:
                for queue in worker.queues:
                    idle[queue] += max(0, worker.slots - worker.busy)
    return served, idle


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=utcnow().tzinfo)


def redeliver_lost_messages(settings: Settings, now: datetime | None = None) -> list[str]:
    """Re-send the queued jobs whose message looks lost (module docstring); returns their ids."""
    from service_core.queue import send_once

    now = now or utcnow()
    served, idle = idle_slots_by_queue(settings, now)
    if not served:
        return []
    older = now - timedelta(seconds=settings.redeliver_after_seconds)
    queued = (Job.status == JobStatus.queued.value, Job.created_at < older)
    picked: list[tuple[str, str, int, datetime | None]] = []
    with session_scope(settings.database_url) as session:
        never_sent = select(Job.id, Job.queue, Job.priority, Job.enqueued_at).where(
            *queued, Job.enqueued_at.is_(None), Job.waiting_reason.is_(None), Job.queue.in_(sorted(served))
        )  # held jobs (the running-jobs cap) are sent by resend_waiting, as places free up
        picked.extend(session.execute(never_sent).tuples())
        for queue, slots in idle.items():
            stale = (select(Job.id, Job.queue, Job.priority, Job.enqueued_at)
                     .where(*queued, Job.queue == queue, Job.enqueued_at < older)
                     .order_by(Job.priority.desc(), Job.created_at).limit(slots))  # fmt: skip
            picked.extend(session.execute(stale).tuples())
    sent = []
    for job_id, queue, priority, enqueued_at in picked:
        # Compare-and-set on the stamp: two sweeps (or a sweep and a requeue) never both send.
        same = Job.enqueued_at.is_(None) if enqueued_at is None else Job.enqueued_at == enqueued_at
        still_queued = [Job.status == JobStatus.queued.value, same]
        if send_once(settings, job_id, queue, priority, still_queued, {"enqueued_at": now}):
            sent.append(job_id)
    if sent:
        log.warning("re-sent %d queued jobs whose queue message looked lost: %s", len(sent), sent)
    return sent


def sweep(settings: Settings, *, recover: bool = True) -> dict[str, Any]:
    """One sweep (the caller holds the sweeper lease, or is starting): recover orphans, re-send messages.

    ``recover=False`` leaves running jobs alone (the database was just away: see :class:`Sweeper`).
    """
    recovered = recover_orphaned_jobs(settings) if recover else {}
    if recovered:
        log.warning("recovered jobs of lost slots: %s", recovered)
    resent = redeliver_lost_messages(settings) + resend_waiting(settings) + resend_gangs(settings)
    return {"recovered": recovered, "redelivered": resent}


class Sweeper:
    """The worker main process's periodic duties: its heartbeat row, and the sweep when it holds the lease."""

    def __init__(self, settings: Settings, queues: Sequence[str], name: str) -> None:
        self.settings, self.queues, self.name = settings, list(queues), name
        self.device = device_budget()  # reported with each heartbeat: `auto` batches are sized for it
        self.address = advertise_address(settings)
        self.slot_pids: list[int] = []
        self.next_beat = self.next_sweep = 0.0
        # After the database was away, the slots renew their leases before anything is called lost.
        self.recover_after = 0.0

    def tick(self, now: float) -> None:
        """Call often (monotonic ``now``); does what is due, and logs a database error instead of raising."""
        try:
            if now >= self.next_beat and self.slot_pids:
                self.next_beat = now + self.settings.lease_renew_seconds
                beat(self.settings, self.name, self.queues, self.slot_pids, self.device, self.address)
                self._database_answered(now)
            if now >= self.next_sweep:
                self.next_sweep = now + self.settings.sweep_seconds
                if take_lease(self.settings, SWEEPER_LEASE, self.name, 2 * self.settings.sweep_seconds):
                    self._database_answered(now)
                    sweep(self.settings, recover=now >= self.recover_after)
        except Exception:  # a database or broker blip: the next tick tries again
            log.exception("worker %s: heartbeat or sweep failed", self.name)
            self.recover_after = math.inf

    def _database_answered(self, now: float) -> None:
        if self.recover_after == math.inf:  # back after an outage: two renewals' time before recovering
            self.recover_after = now + 2 * self.settings.lease_renew_seconds

    def close(self) -> None:
        """Drop this worker's row and hand the sweeper lease on (best effort)."""
        try:
            forget_worker(self.settings, self.name)
            release_lease(self.settings, SWEEPER_LEASE, self.name)
        except Exception:
            log.exception("worker %s: leaving the registry failed", self.name)
