"""What fires the stream signals of api/event_feed.py: one PostgreSQL listener and one ``last_seq``
watcher per API process, never one query per stream.

- PostgreSQL: a dedicated connection ``LISTEN``s on the channel every event append notifies
  (service_core/db/event_notify.py) and wakes the job it names, as soon as the writer commits. It
  checks itself every ``HEALTH_CHECK_S`` and reconnects after a database blip; on every (re)connect it
  wakes all streams, since notifications sent while it was away are gone.
- Every database: the watcher reads ``jobs.last_seq`` of the jobs streams follow, in one query, and
  wakes those that moved. On SQLite (no channel; the worker writes from another process) that is how
  streams learn of new rows, every ``SQLITE_WATCH_S``. On PostgreSQL it is the safety net, every
  ``SAFETY_POLL_S``: a lost notification delays an event by at most that, never loses it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import anyio
import anyio.to_thread
import psycopg
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.event_feed import JobWakeups
from service_core.db.event_notify import EVENTS_CHANNEL, libpq_url
from service_core.db.models import Job
from service_core.db.session import CONNECT_TIMEOUT_S

logger = logging.getLogger(__name__)

SQLITE_WATCH_S = 0.2
SAFETY_POLL_S = 3.0
HEALTH_CHECK_S = 10.0
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.5, 10.0
IN_CHUNK = 500  # job ids per watcher query


@dataclass
class ListenerState:
    """How the PostgreSQL listener fares (for logs and tests): connected now, connections made."""

    connected: bool = False
    connects: int = 0


def read_last_seqs(maker: sessionmaker[Session], job_ids: list[str]) -> dict[str, int]:
    """``jobs.last_seq`` by id for ``job_ids`` (ids of deleted jobs are absent)."""
    seqs: dict[str, int] = {}
    with maker() as session:
        for i in range(0, len(job_ids), IN_CHUNK):
            chunk = job_ids[i : i + IN_CHUNK]
            rows = session.execute(select(Job.id, Job.last_seq).where(Job.id.in_(chunk)))
            seqs.update({job_id: int(seq) for job_id, seq in rows})
    return seqs


async def watch_last_seqs(
    maker: sessionmaker[Session], wakeups: JobWakeups, interval_s: float, limiter: anyio.CapacityLimiter
) -> None:
    """Every ``interval_s``, wake the followed jobs whose ``last_seq`` changed since the last look.

    The memory (``seen_seq``) is the watcher's own: a row committed after one look changes what the
    next look sees, so every commit is followed by a wake-up issued after it.
    """
    while True:
        await asyncio.sleep(interval_s)
        job_ids = list(wakeups.jobs)
        if not job_ids:
            continue
        try:
            seqs = await anyio.to_thread.run_sync(read_last_seqs, maker, job_ids, limiter=limiter)
        except Exception:  # a database blip must not end the watcher; the next look retries
            logger.warning("event watcher: reading jobs.last_seq failed; retrying", exc_info=True)
            continue
        for job_id in job_ids:
            job = wakeups.jobs.get(job_id)
            seq = seqs.get(job_id)
            if job is not None and seq != job.seen_seq:
                job.seen_seq = seq
                job.fire()


async def listen_for_events(database_url: str, wakeups: JobWakeups, state: ListenerState) -> None:
    """Wake jobs as PostgreSQL notifies them, reconnecting (with backoff) for as long as the app runs."""
    conninfo = libpq_url(database_url)
    delay = RECONNECT_MIN_S
    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
            async with conn:
                await conn.execute(f"LISTEN {EVENTS_CHANNEL}")
                state.connected, state.connects, delay = True, state.connects + 1, RECONNECT_MIN_S
                wakeups.wake_all()  # whatever was notified while no one listened
                while True:
                    async for note in conn.notifies(timeout=HEALTH_CHECK_S):
                        wakeups.wake(note.payload)
                    # A server that vanished without a reset would leave notifies() waiting forever.
                    await asyncio.wait_for(conn.execute("SELECT 1"), HEALTH_CHECK_S)
        except (psycopg.Error, OSError, TimeoutError) as exc:
            logger.warning("event listener: %s; reconnecting in %.1f s", exc, delay)
        state.connected = False
        await asyncio.sleep(delay)
        delay = min(2 * delay, RECONNECT_MAX_S)


def start_event_feed(
    database_url: str, maker: sessionmaker[Session], wakeups: JobWakeups, state: ListenerState,
    limiter: anyio.CapacityLimiter,
) -> list[asyncio.Task[None]]:  # fmt: skip
    """The listener (PostgreSQL) and the watcher for this database, as tasks on the running loop."""
    if database_url.startswith("postgresql"):
        tasks = [asyncio.create_task(listen_for_events(database_url, wakeups, state), name="event-listener")]
        interval = SAFETY_POLL_S
    else:
        tasks, interval = [], SQLITE_WATCH_S
    tasks.append(asyncio.create_task(watch_last_seqs(maker, wakeups, interval, limiter), name="event-watcher"))
    return tasks
