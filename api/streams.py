"""Slots for long-lived responses (event streams): a cap per owner and per API process.

A stream costs no thread and no database connection while it waits (api/routes/events.py), but
each one it wakes reads the database (api/event_feed.py); without a cap a single owner could open
thousands and slow every stream's reads, and the one query that watches their jobs. The count
is per API process (``trainjobs serve --api-processes N`` allows N times as many), kept on the event
loop thread only, so it needs no lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterable, Iterable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.problems import Problem

# Streams last minutes; a client over its cap should not retry in a tight loop.
RETRY_AFTER_S = 10


class StreamSlots:
    """Counts open streams by owner; ``take`` gives a slot or raises a 429 problem."""

    def __init__(self, per_owner: int, total: int) -> None:
        self.per_owner, self.total = per_owner, total
        self.open: Counter[str] = Counter()

    def take(self, owner: str) -> StreamSlot:
        if self.open[owner] >= self.per_owner:
            raise self._busy(f"at most {self.per_owner} open event streams per owner (TRAINJOBS_MAX_STREAMS_PER_OWNER)")
        if sum(self.open.values()) >= self.total:
            raise self._busy(f"this API process serves at most {self.total} event streams (TRAINJOBS_MAX_STREAMS)")
        self.open[owner] += 1
        return StreamSlot(self, owner)

    def give_back(self, owner: str) -> None:
        self.open[owner] -= 1
        if self.open[owner] <= 0:
            del self.open[owner]

    @staticmethod
    def _busy(detail: str) -> Problem:
        return Problem(429, detail + "; close one or retry later", headers={"Retry-After": str(RETRY_AFTER_S)})


class StreamSlot:
    """One taken slot; giving it back twice is harmless."""

    def __init__(self, slots: StreamSlots, owner: str) -> None:
        self.slots, self.owner, self.held = slots, owner, True

    def give_back(self) -> None:
        if self.held:
            self.held = False
            self.slots.give_back(self.owner)


class SlotStreamingResponse(StreamingResponse):
    """A streaming response that gives its slot back however it ends (done, error, disconnect).

    Giving it back here rather than in the body generator also covers a client that goes away
    before the generator first runs (a generator that never started runs no ``finally``).
    """

    def __init__(self, content: AsyncIterable[str] | Iterable[str], slot: StreamSlot, **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self.slot = slot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.slot.give_back()
