"""kombu's Redis transport, with one publishing client per channel instead of one per message.

kombu's ``Channel.conn_or_acquire`` builds a new ``redis.Redis`` for every message it publishes,
and that constructor (it copies redis-py's response-callback table) costs more than the LPUSH it
is for: a fifth of the API's CPU per job submission went to Celery's publish path, a quarter of
that to building clients (bench/bench_api.py, py-spy). The client here shares the channel's
connection pool, as kombu's own clients do, and redis-py clients are safe to share between threads.

Selected by ``service_core.queue.celery_config`` for ``redis://`` and ``rediss://`` broker URLs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cached_property
from typing import Any

from kombu.transport import redis as kombu_redis


class Channel(kombu_redis.Channel):  # type: ignore[misc]
    @cached_property
    def _shared_client(self) -> Any:
        return self._create_client()

    @contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        yield client or self._shared_client


class Transport(kombu_redis.Transport):  # type: ignore[misc]
    Channel = Channel
