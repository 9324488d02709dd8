"""The consuming half of the Celery setup: the app the worker slots run, and queue declaration.

``celery -A worker.celery_app worker`` finds the app as ``worker.celery_app:app``. The configuration
and enqueueing live in :mod:`service_core.queue`, shared with the API.
"""

from __future__ import annotations

from collections.abc import Sequence
from queue import Empty
from typing import Any

from kombu import Exchange, Queue
from kombu.transport import sqlalchemy as kombu_sqlalchemy
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from service_core.queue import celery_for
from service_core.settings import Settings, get_settings


def declare_queues(queues: Sequence[str], settings: Settings | None = None, attempts: int = 3) -> None:
    """Create ``queues`` on the broker (a direct exchange and binding each, as Celery's own).

    Call it once before several consumers start: kombu's SQLAlchemy transport (the embedded broker)
    creates a queue's row with a plain INSERT on first use, so two worker slots starting together on
    a fresh broker race on it and the loser dies on the UNIQUE constraint. Each attempt uses a fresh
    connection, since the losing one's session is left unusable.
    """
    app = celery_for(settings or get_settings())
    for attempt in range(1, attempts + 1):
        try:
            with app.connection_for_write() as conn:
                channel = conn.default_channel
                for name in queues:
                    Queue(name, Exchange(name, type="direct"), routing_key=name, channel=channel).declare()
            return
        except IntegrityError:
            if attempt == attempts:
                raise



# The embedded broker (kombu's SQLAlchemy transport) polls its message table; kombu's default of 1 s
# put 0.5 s on average between a submit and its pickup (bench/bench_service_overhead.py). At 0.1 s
# an idle slot runs 10 small queries a second. Set on the class because that transport hands every
# broker_transport_option to create_engine, which refuses unknown ones. Redis blocks on BRPOP instead.
EMBEDDED_POLL_S = 0.1


class EmbeddedChannel(kombu_sqlalchemy.Channel):
    """kombu's SQLAlchemy channel, with a cheap look before each take.

    kombu's take opens a write transaction (``BEGIN IMMEDIATE`` on SQLite: the database's write lock)
    and runs two ORM queries, ten times a second on an idle slot: ~2% of a core each, and a write lock
    the API's submits wait behind. One plain SELECT on a pooled connection says first whether the queue
    holds a visible message; only then does kombu's locked take run, which stays the one that decides
    (a message another slot took in between is an Empty, as before).
    """

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        message, named = self.message_cls, self.queue_cls
        # Built each poll: SQLAlchemy's statement cache compiles it once per channel's tables.
        peek = (
            select(message.id)
            .join(named, message.queue_id == named.id)
            .where(named.name == queue, message.visible != False)  # noqa: E712  # kombu's own test
            .limit(1)
        )
        with self.session.bind.connect() as connection:
            if connection.execute(peek).first() is None:
                raise Empty()
        return super()._get(queue)


kombu_sqlalchemy.Transport.polling_interval = EMBEDDED_POLL_S
kombu_sqlalchemy.Transport.Channel = EmbeddedChannel

# The app `celery -A worker.celery_app` and the worker slots use, built from the environment.
app = celery_for(get_settings())
# Only consumers import the task module (at worker start); the API, which only sends, never does.
app.conf.include = ["worker.tasks"]
