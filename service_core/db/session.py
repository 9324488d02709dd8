"""The engine and sessions: one engine per process, built from the settings."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from sqlalchemy import ColumnElement, Engine, create_engine, event, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from service_core.settings import get_settings

CONNECT_TIMEOUT_S = 5
IDLE_IN_TRANSACTION_TIMEOUT = "25P03"  # PostgreSQL's SQLSTATE: the server ended an idle transaction
# Errors that say the database is unreachable or saturated, not that a statement or a row is wrong:
# the API answers them with 503, the worker rides them out (worker/db_retry.py).
DATABASE_UNAVAILABLE = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)


def make_engine(url: str, *, pool_size: int | None = None) -> Engine:
    """An engine with the settings each backend needs for several writer processes.

    ``pool_size``: connections kept open (server databases only). The default (5) suits scripts and
    the worker; a busy API process needs more, or every request beyond the fifth concurrent one
    opens a new connection and closes it again (a PostgreSQL backend start each time).
    """
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
    else:
        if url.startswith("postgresql"):
            # A server that stops answering (not refusing) fails a connect in seconds, not never.
            kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
        if pool_size is not None:
            kwargs["pool_size"] = pool_size
    engine = create_engine(url, **kwargs)
    if url.startswith("postgresql"):

        @event.listens_for(engine, "connect")
        def _custom_plans(dbapi_conn: Any, _record: Any) -> None:
            # psycopg prepares a statement on its fifth run, and PostgreSQL then may plan it once for
            # any parameters. Without the values, the deep keyset page (owner, cursor) looks like 33
            # rows and becomes "every older job of the owner, then sort": a cost that grows with the
            # history (bench/bench_history.py, history_plans.py). A plan per execution costs ~0.1 ms.
            dbapi_conn.execute("SET plan_cache_mode = force_custom_plan")
            dbapi_conn.commit()  # left in a transaction, the pool's rollback on return would undo it

        @event.listens_for(engine, "handle_error")
        def _idle_timeout_is_unavailable(ctx: Any) -> Exception | None:
            # A worker slot's connections end a transaction idle past the lease (worker/main.py:
            # slot_database_url). psycopg reports that as an InternalError (SQLSTATE 25P03), but for
            # the caller it is a lost connection: the transaction was rolled back and a retry on a
            # new connection is right (its writes are fenced by attempt). Without this a slot that
            # was merely slow under load failed a healthy job (chaos R6 on a loaded machine).
            if getattr(ctx.original_exception, "sqlstate", None) == IDLE_IN_TRANSACTION_TIMEOUT:
                ctx.is_disconnect = True
                return sa_exc.OperationalError(ctx.statement, ctx.parameters, ctx.original_exception)
            return None

    if url.startswith("sqlite"):

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            # WAL lets the API read while the worker writes; busy_timeout waits instead of failing.
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

    return engine


@lru_cache(maxsize=4)
def get_engine(url: str | None = None) -> Engine:
    return make_engine(url or get_settings().database_url)


@lru_cache(maxsize=4)
def get_sessionmaker(url: str | None = None) -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error (for the worker and scripts)."""
    session = get_sessionmaker(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def allocate_seqs(session: Session, job_id: str, count: int, *conditions: ColumnElement[bool]) -> int | None:
    """Reserve ``count`` event numbers for a job atomically; returns the first one.

    A single UPDATE ... RETURNING is atomic on PostgreSQL and SQLite alike, so the API and a worker
    writing events for the same job never hand out the same number. ``conditions`` (a fencing token)
    narrow the UPDATE: when the row no longer matches them nothing is reserved and None comes back.
    """
    from service_core.db.models import Job

    last = session.execute(
        update(Job).where(Job.id == job_id, *conditions).values(last_seq=Job.last_seq + count).returning(Job.last_seq)
    ).scalar_one_or_none()
    return None if last is None else int(last) - count + 1


def ping(session: Session) -> None:
    session.execute(text("SELECT 1"))
