"""Event streams cannot take the API down: many open streams leave every other route answering,
one owner's streams are capped (429 with Retry-After), and bursts of reads never exhaust the pool."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.orm import Session

from api.main import create_app
from service_core.db.jobstore import add_events, transition
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.api.conftest import Keys, add_job
from tests.api.live import serve
from trainjobs.sse import iter_events

pytestmark = pytest.mark.both_databases

STREAMS = 48  # many more than the database pool and the threads of an API process
PER_OWNER = 3


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings.model_copy(update={"max_streams_per_owner": STREAMS}))


@pytest.fixture
def live_url(app: FastAPI) -> Iterator[str]:
    with serve(app) as url:
        yield url


def hold_stream(url: str, key: str, opened: threading.Semaphore, seen: list[str]) -> None:
    """Read a stream to its end; release ``opened`` once its first event arrived."""
    with httpx.stream("GET", url, headers=Keys.auth(key), timeout=120) as response:
        assert response.status_code == 200
        for n, event in enumerate(iter_events(response)):
            seen.append(event.event)
            if n == 0:
                opened.release()


@pytest.mark.slow
def test_many_open_streams_leave_every_other_route_answering(live_url: str, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    transition(session, job.id, JobStatus.running)
    session.commit()
    opened = threading.Semaphore(0)
    seen: list[list[str]] = [[] for _ in range(STREAMS)]
    url = f"{live_url}/v1/jobs/{job.id}/events"
    threads = [threading.Thread(target=hold_stream, args=(url, keys.alice, opened, seen[i])) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    for _ in range(STREAMS):
        assert opened.acquire(timeout=60), "a stream did not open"
    # Every stream is open and polling: the rest of the API answers, and answers right.
    with httpx.Client(base_url=live_url, headers=keys.auth(keys.alice), timeout=60) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json()["checks"]["database"] == "ok"
        assert [j["id"] for j in client.get("/v1/jobs").json()["items"]] == [job.id]
        assert client.get(f"/v1/jobs/{job.id}").json()["status"] == "running"
    add_events(session, job.id, [("metric", {"step": 1, "values": {"loss": 0.5}}, None)])
    transition(session, job.id, JobStatus.succeeded)
    session.commit()
    for thread in threads:
        thread.join(timeout=60)
    assert all(s == ["status", "metric", "status"] for s in seen), seen


def test_an_owner_over_the_stream_limit_gets_429(settings: Settings, keys: Keys, session: Session) -> None:
    app = create_app(settings.model_copy(update={"max_streams_per_owner": PER_OWNER}))
    job = add_job(session, "alice", JobStatus.running)
    with serve(app) as live:
        opened = threading.Semaphore(0)
        url = f"{live}/v1/jobs/{job.id}/events"
        threads = [threading.Thread(target=hold_stream, args=(url, keys.alice, opened, [])) for _ in range(PER_OWNER)]
        add_events(session, job.id, [("metric", {"step": 1, "values": {"loss": 0.5}}, None)])
        session.commit()
        for thread in threads:
            thread.start()
        for _ in range(PER_OWNER):
            assert opened.acquire(timeout=30)
        over = httpx.get(url, headers=keys.auth(keys.alice), timeout=30)
        assert over.status_code == 429
        assert over.headers["content-type"] == "application/problem+json"
        assert int(over.headers["Retry-After"]) >= 1
        assert "TRAINJOBS_MAX_STREAMS_PER_OWNER" in over.json()["detail"]
        # Another owner is not affected by alice's streams.
        bobs = add_job(session, "bob", JobStatus.succeeded)
        assert httpx.get(f"{live}/v1/jobs/{bobs.id}/events", headers=keys.auth(keys.bob), timeout=30).status_code == 200
        transition(session, job.id, JobStatus.succeeded)
        session.commit()
        for thread in threads:
            thread.join(timeout=30)
        # Ended streams give their slots back.
        again = httpx.get(url, headers=keys.auth(keys.alice), timeout=30)
        assert again.status_code == 200


def test_a_burst_of_job_reads_never_fails(live_url: str, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    limits = httpx.Limits(max_connections=64)
    client = httpx.Client(base_url=live_url, headers=keys.auth(keys.alice), timeout=120, limits=limits)

    def read(_: int) -> Any:
        response = client.get(f"/v1/jobs/{job.id}")
        return response.status_code, response.json().get("id")

    with client, ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(read, range(64)))
    assert answers == [(200, job.id)] * 64
