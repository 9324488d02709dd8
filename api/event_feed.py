"""In-process fan-out for event streams: one wake-up signal per watched job, and one shared read per
(job, position) however many streams wait there.

Streams never poll. A stream takes its job's current signal *before* it reads the database, reads,
sends what it found and then waits on that signal; whoever learns that a job has new rows (the
PostgreSQL listener or the ``jobs.last_seq`` watcher, api/event_listeners.py) fires it. Taking the
signal before the read means a wake-up that lands during the read is not lost: the stream reads
again at once. Everything here lives on the event loop thread, so it needs no lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

T = TypeVar("T")


class WatchedJob:
    """The streams waiting on one job: how many, their signal, and the last ``last_seq`` the watcher saw."""

    def __init__(self) -> None:
        self.streams = 0
        self.signal = asyncio.Event()
        self.seen_seq: int | None = None  # the watcher's own memory (api/event_listeners.py)

    def fire(self) -> None:
        # A fresh Event per wake-up: waiters of the old one all run, later waiters wait for the next.
        self.signal.set()
        self.signal = asyncio.Event()


class JobWakeups:
    """Signals by job id for the jobs that open streams follow (one instance per API process)."""

    def __init__(self) -> None:
        self.jobs: dict[str, WatchedJob] = {}

    @contextmanager
    def watch(self, job_id: str) -> Iterator[WatchedJob]:
        """The job's signal entry while the block runs; dropped when its last stream ends."""
        job = self.jobs.setdefault(job_id, WatchedJob())
        job.streams += 1
        try:
            yield job
        finally:
            job.streams -= 1
            if job.streams == 0 and self.jobs.get(job_id) is job:
                del self.jobs[job_id]

    def wake(self, job_id: str) -> None:
        """New rows for ``job_id`` may have been committed: its streams read again."""
        if (job := self.jobs.get(job_id)) is not None:
            job.fire()

    def wake_all(self) -> None:
        """Notifications may have been missed (the listener reconnected): every stream reads again."""
        for job in self.jobs.values():
            job.fire()


class SharedReads(Generic[T]):
    """Single-flight reads: callers asking for the same key while a read is under way share its result.

    The streams following one job wake together and usually stand at the same position, so one read
    serves them all instead of one per stream. Callers put the signal they hold in the key: a read
    begun under an older signal may predate rows whose wake-up that signal already had, while any row
    a read under the current signal misses will fire it. The read is shielded: a client that goes
    away does not cancel it for the others.
    """

    def __init__(self) -> None:
        self.running: dict[Hashable, asyncio.Future[T]] = {}

    async def read(self, key: Hashable, start: Callable[[], Awaitable[T]]) -> T:
        future = self.running.get(key)
        if future is None:
            future = asyncio.ensure_future(start())
            self.running[key] = future
            future.add_done_callback(lambda _done: self.running.pop(key, None))
        return await asyncio.shield(future)
