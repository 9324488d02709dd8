"""Event streams are pushed, not polled (issue 13, P6/P7): a write by another process or connection
wakes the streams of its job; idle streams run no queries of their own; a lost notification is
caught by the safety poll; the PostgreSQL listener survives a database blip.

Real uvicorn, real HTTP streams, real PostgreSQL / SQLite; events are written with the same
``add_events`` / ``transition`` the worker's ingestion uses, from another process or connection.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import event
from sqlalchemy.orm import Session

from api import event_listeners
from api.main import create_app
from bench.chaos_proxy import TcpProxy
from service_core.db.jobstore import transition
from service_core.db.models import Job, JobEvent
from service_core.db.session import allocate_seqs
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.api.conftest import PG_SERVER, Keys, add_job
from tests.api.live import serve
from trainjobs.sse import iter_events

pytestmark = pytest.mark.both_databases

# What a worker does, in a process of its own: append a metric, or end the job.
WRITER = """
import sys
from service_core.db.jobstore import add_events, transition
from service_core.db.session import session_scope
from service_core.status import JobStatus
url, job_id, what = sys.argv[1:]
with session_scope(url) as session:
    if what == "metric":
        add_events(session, job_id, [("metric", {"step": 1, "values": {"loss": 0.5}}, None)])
    else:
        transition(session, job_id, JobStatus.succeeded)
"""
NEVER_S = 600.0  # a safety poll that never comes within a test: only a push can deliver


def write_in_another_process(url: str, job_id: str, what: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", WRITER, url, job_id, what], check=True, env=env, timeout=120)


class Follower:
    """An SSE client on a thread: parsed events land in a queue as they arrive."""

    def __init__(self, url: str, key: str) -> None:
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._read, args=(url, key), daemon=True)
        self.thread.start()

    def _read(self, url: str, key: str) -> None:
        with httpx.stream("GET", url, headers=Keys.auth(key), timeout=httpx.Timeout(10, read=60)) as response:
            assert response.status_code == 200
            for sse in iter_events(response):
                self.events.put(sse.data)

    def next(self, timeout: float = 30) -> dict[str, Any]:
        return self.events.get(timeout=timeout)


def running_job(session: Session) -> Job:
    job = add_job(session, "alice")
    transition(session, job.id, JobStatus.running)  # event 1: every follower's first event
    session.commit()
    return job


def finish(session: Session, *jobs: Job) -> None:
    """End the jobs, which ends their streams (so the server stops at once when the test is over)."""
    for job in jobs:
        transition(session, job.id, JobStatus.succeeded)
    session.commit()


def follow(live_url: str, job: Job, keys: Keys) -> Follower:
    follower = Follower(f"{live_url}/v1/jobs/{job.id}/events", keys.alice)
    assert follower.next()["status"] == "running"
    return follower


def test_a_write_by_another_process_is_pushed_and_the_end_closes_the_stream(
    app: FastAPI, database_url: str, keys: Keys, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(event_listeners, "SAFETY_POLL_S", NEVER_S)  # PostgreSQL: only NOTIFY can deliver
    job = running_job(session)
    with serve(app) as live_url:
        follower = follow(live_url, job, keys)
        write_in_another_process(database_url, job.id, "metric")
        assert follower.next()["values"] == {"loss": 0.5}
        write_in_another_process(database_url, job.id, "end")
        assert follower.next()["status"] == "succeeded"
        follower.thread.join(timeout=30)
        assert not follower.thread.is_alive()  # the terminal status ended the stream


def count_statements(app: FastAPI) -> tuple[list[str], Callable[[], None]]:
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(statement)

    event.listen(app.state.engine, "before_cursor_execute", record)
    return seen, lambda: event.remove(app.state.engine, "before_cursor_execute", record)


def test_idle_streams_run_no_queries_of_their_own(
    app: FastAPI, database_url: str, keys: Keys, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval = 1.0 if database_url.startswith("postgresql") else event_listeners.SQLITE_WATCH_S
    monkeypatch.setattr(event_listeners, "SAFETY_POLL_S", interval)
    streams, idle_s = 12, 3.0
    jobs = [running_job(session) for _ in range(3)]
    with serve(app) as live_url:
        followers = [follow(live_url, jobs[i % len(jobs)], keys) for i in range(streams)]
        time.sleep(3 * interval)  # the watcher's first look (which wakes every job once) is over
        statements, stop = count_statements(app)
        time.sleep(idle_s)
        stop()
        # Polling streams would read job_events streams * idle_s / 0.1 times; these read it never.
        assert not [s for s in statements if "job_events" in s]
        # What remains is the one watcher of the process: one jobs.last_seq look per interval.
        assert len(statements) <= idle_s / interval + 2, statements
        write_in_another_process(database_url, jobs[0].id, "metric")
        for follower in followers[:: len(jobs)]:  # the followers of jobs[0] all get it
            assert follower.next()["values"] == {"loss": 0.5}
        finish(session, *jobs)


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_lost_notification_is_caught_by_the_safety_poll(
    app: FastAPI, keys: Keys, session: Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(event_listeners, "SAFETY_POLL_S", 2.0)
    job = running_job(session)
    with serve(app) as live_url:
        follower = follow(live_url, job, keys)
        # An event row committed without its NOTIFY, as if the notification were lost on the way.
        seq = allocate_seqs(session, job.id, 1)
        assert seq is not None
        session.add(JobEvent(job_id=job.id, seq=seq, kind="metric", data={"step": 1, "values": {"loss": 0.25}}))
        session.commit()
        written = time.monotonic()
        assert follower.next()["values"] == {"loss": 0.25}
        # The correctness bound (one safety poll), with room for a loaded machine; never "never".
        assert time.monotonic() - written < 10 * 2.0
        finish(session, job)


@pytest.fixture
def proxied_app(settings: Settings, pg_url: str) -> Iterator[tuple[FastAPI, TcpProxy]]:
    """An app whose database connections all pass through a proxy the test can cut."""
    with TcpProxy(("127.0.0.1", 5432)) as proxy:
        url = pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
        yield create_app(settings.model_copy(update={"database_url_": url})), proxy


@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_the_listener_reconnects_after_a_database_blip(
    proxied_app: tuple[FastAPI, TcpProxy], database_url: str, keys: Keys, session: Session,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setattr(event_listeners, "SAFETY_POLL_S", NEVER_S)
    app, proxy = proxied_app
    assert database_url.startswith(PG_SERVER)  # the writer below goes around the proxy
    job = running_job(session)
    with serve(app) as live_url:
        follower = follow(live_url, job, keys)
        state = app.state.event_listener
        proxy.cut()
        wait_for(lambda: not state.connected)
        proxy.restore()
        wait_for(lambda: state.connected and state.connects == 2)
        write_in_another_process(database_url, job.id, "metric")
        assert follower.next()["values"] == {"loss": 0.5}
        finish(session, job)


def wait_for(condition: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
