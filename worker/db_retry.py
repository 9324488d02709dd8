"""Riding out a database that goes away for a while (a restart, a failover, a network cut).

A healthy run is never abandoned because its supervisor could not write for a minute: writes that
fail with :data:`service_core.db.session.DATABASE_UNAVAILABLE` are retried with backoff, and nothing
buffered is dropped in between (the ingestor keeps its events until a write succeeds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from service_core.db.session import DATABASE_UNAVAILABLE

log = logging.getLogger(__name__)

T = TypeVar("T")

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 5.0
# How long the end of a run (final events, outcome, requeue) waits for the database before giving up.
FINISH_BUDGET_S = 180.0


class Backoff:
    """When to try the database again during an outage, and how long the outage has lasted."""

    def __init__(self, what: str, first_s: float = FIRST_DELAY_S, max_s: float = MAX_DELAY_S) -> None:
        self.what, self.first_s, self.max_s = what, first_s, max_s
        self.since: float | None = None
        self.delay = first_s
        self.next_try = 0.0

    def ready(self, now: float) -> bool:
        return now >= self.next_try

    def failed(self, now: float, exc: BaseException) -> None:
        if self.since is None:
            self.since = now
            log.warning("%s: database unavailable (%s); retrying", self.what, type(exc).__name__)
        else:
            self.delay = min(self.delay * 2, self.max_s)
        self.next_try = now + self.delay

    def succeeded(self, now: float) -> None:
        if self.since is not None:
            log.info("%s: database back after %.1fs", self.what, now - self.since)
        self.since, self.delay, self.next_try = None, self.first_s, 0.0


def retry_database(action: Callable[[], T], what: str, budget_s: float = FINISH_BUDGET_S) -> T:
    """``action()``, retried with backoff while the database is unavailable, for up to ``budget_s``."""
    backoff = Backoff(what)
    deadline = time.monotonic() + budget_s
    while True:
        try:
            result = action()
        except DATABASE_UNAVAILABLE as exc:
            now = time.monotonic()
            if now >= deadline:
                raise
            backoff.failed(now, exc)
            time.sleep(max(0.0, min(backoff.next_try, deadline) - now))
            continue
        backoff.succeeded(time.monotonic())
        return result
