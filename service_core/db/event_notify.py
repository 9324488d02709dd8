"""Who wakes event streams: every append of job events (status moves included) announces its job on
PostgreSQL's ``job_events`` channel, inside the writing transaction.

``NOTIFY`` inside a transaction is delivered when (and only if) it commits, so a listener that hears
a job id can read the new rows at once; identical notifications of one transaction are delivered once.
The API listens (api/event_listeners.py). SQLite has no such channel: there the API watches
``jobs.last_seq`` instead. Either way the rows in the database stay the source of truth: a
notification only says "read again".
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

EVENTS_CHANNEL = "job_events"


def notify_new_events(session: Session, job_id: str) -> None:
    """Announce new events of ``job_id`` when the session's transaction commits (PostgreSQL only)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(select(func.pg_notify(EVENTS_CHANNEL, job_id)))


def libpq_url(database_url: str) -> str:
    """The SQLAlchemy URL ``postgresql+psycopg://...`` as a URL psycopg connects to directly."""
    return make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
