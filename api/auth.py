"""The API's side of keys: a per-process cache of keys it has checked (the keys themselves live in
:mod:`service_core.keys`)."""

from __future__ import annotations

import time

from service_core.keys import Caller


class KeyCache:
    """Callers of keys this process accepted in the last ``ttl`` seconds, by key hash.

    Without it every request spends a database round trip (and a thread hand-off) on a lookup
    whose answer almost never changes; that was a seventh of a submit's CPU. The price is that a
    revoked key keeps working for up to ``ttl`` seconds in a process that saw it just before
    (``TRAINJOBS_AUTH_CACHE_SECONDS``; 0 asks the database every time). Unknown keys are never
    cached, so a new key works at once. Used from the event loop thread only: no lock.
    """

    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Caller]] = {}

    def get(self, key_hash: str) -> Caller | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._entries[key_hash]
            return None
        return entry[1]

    def put(self, key_hash: str, caller: Caller) -> None:
        if self.ttl <= 0:
            return
        if len(self._entries) >= self.max_entries:
            # Many distinct keys at once is rare: start over rather than track ages.
            self._entries.clear()
        self._entries[key_hash] = (time.monotonic() + self.ttl, caller)
