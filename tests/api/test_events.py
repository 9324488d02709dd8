"""Server-Sent Events: replay, resume with Last-Event-ID (no gaps, no repeats), live streaming."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.event_feed import JobWakeups, SharedReads
from service_core.db.jobstore import add_events, transition
from service_core.db.models import Job
from service_core.status import ErrorReason, JobStatus
from tests.api.conftest import Keys, add_job
from tests.api.live import serve
from tests.worker.live import read_sse

pytestmark = pytest.mark.both_databases


def parse_sse(response: Any) -> list[dict[str, Any]]:
    """The events of a TestClient answer, by the suite's one SSE reader (the TestClient's responses are
    httpx2's, so the body is handed over as an httpx response)."""
    return read_sse(
        httpx.Response(response.status_code, headers=response.headers.multi_items(), content=response.content)
    )


def write_a_run(session: Session, job: Job, metrics: int) -> None:
    """What a slot writes for a run: running, progress and metric events, then success."""
    transition(session, job.id, JobStatus.running)
    for step in range(1, metrics + 1):
        add_events(
            session,
            job.id,
            [
                ("progress", {"step": step, "total_steps": metrics, "epoch": step / metrics}, None),
                ("metric", {"step": step, "values": {"loss": 1.0 / step}}, None),
            ],
        )
    transition(session, job.id, JobStatus.succeeded)
    session.commit()


def read_events(client: TestClient, job_id: str, key: str, **headers: str) -> list[dict[str, Any]]:
    response = client.get(f"/v1/jobs/{job_id}/events", headers={**Keys.auth(key), **headers})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_sse(response)


def test_replay_sends_every_event_in_order_and_ends(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    write_a_run(session, job, metrics=3)
    events = read_events(client, job.id, keys.alice)
    assert [e["id"] for e in events] == list(range(1, 9))
    assert [e["event"] for e in events] == ["status", *["progress", "metric"] * 3, "status"]
    assert events[0]["data"]["status"] == "running" and events[-1]["data"]["status"] == "succeeded"
    assert events[2]["data"]["values"] == {"loss": 1.0}
    assert all(e["data"]["seq"] == e["id"] and e["data"]["time"].endswith("+00:00") for e in events)


def test_wire_format(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    transition(session, job.id, JobStatus.cancelled, reason=ErrorReason.cancelled)
    session.commit()
    body = client.get(f"/v1/jobs/{job.id}/events", headers=keys.auth(keys.alice)).text
    head, data = body.split("data: ")
    assert head == "id: 1\nevent: status\n"
    assert data.endswith("\n\n")
    assert json.loads(data)["status"] == "cancelled"


def test_resume_with_last_event_id_has_no_gaps_or_repeats(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    write_a_run(session, job, metrics=5)
    full = read_events(client, job.id, keys.alice)
    for last in (0, 1, 4, 11):
        resumed = read_events(client, job.id, keys.alice, **{"Last-Event-ID": str(last)})
        assert full[:last] + resumed == full
    by_query = client.get(f"/v1/jobs/{job.id}/events", params={"after": 4}, headers=keys.auth(keys.alice))
    assert parse_sse(by_query) == full[4:]
    # after the terminal event there is nothing left: the stream ends at once
    assert read_events(client, job.id, keys.alice, **{"Last-Event-ID": str(len(full))}) == []


def test_bad_last_event_id_is_422(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.succeeded)
    response = client.get(f"/v1/jobs/{job.id}/events", headers={**keys.auth(keys.alice), "Last-Event-ID": "abc"})
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "last-event-id"


def test_events_not_found_not_yours_and_unauthenticated(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.succeeded)
    assert client.get("/v1/jobs/nope/events", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get(f"/v1/jobs/{job.id}/events", headers=keys.auth(keys.bob)).status_code == 404
    assert client.get(f"/v1/jobs/{job.id}/events").status_code == 401
    assert client.get(f"/v1/jobs/{job.id}/events", headers=keys.auth(keys.admin)).status_code == 200


@pytest.fixture
def live_url(app: FastAPI) -> Iterator[str]:
    """The app served by a real uvicorn on a free local port (streams arrive as they are written)."""
    with serve(app) as url:
        yield url


def stream_events(url: str, key: str, seen: list[dict[str, Any]], stop_after: int | None = None) -> None:
    """Read an event stream into ``seen`` (resuming after its last id); stop early after ``stop_after``."""
    headers = Keys.auth(key) | ({"Last-Event-ID": str(seen[-1]["id"])} if seen else {})
    with httpx.stream("GET", url, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        seen.extend(read_sse(response, None if stop_after is None else stop_after - len(seen)))


def test_live_stream_with_a_reconnect(live_url: str, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    transition(session, job.id, JobStatus.running)
    session.commit()
    url = f"{live_url}/v1/jobs/{job.id}/events"
    seen: list[dict[str, Any]] = []

    def worker() -> None:
        # Events arrive while the client reads, across its disconnect and reconnect.
        for step in range(1, 31):
            add_events(session, job.id, [("metric", {"step": step, "values": {"loss": 1 / step}}, None)])
            session.commit()
            time.sleep(0.02)
        transition(session, job.id, JobStatus.succeeded)
        session.commit()

    writer = threading.Thread(target=worker)
    started = time.monotonic()
    writer.start()
    stream_events(url, keys.alice, seen, stop_after=5)  # drop the connection mid-run...
    stream_events(url, keys.alice, seen)  # ...and resume with Last-Event-ID until the end
    writer.join()
    assert [e["id"] for e in seen] == list(range(1, 33))
    assert [e["data"]["step"] for e in seen if e["event"] == "metric"] == list(range(1, 31))
    assert seen[-1]["event"] == "status" and seen[-1]["data"]["status"] == "succeeded"
    assert time.monotonic() - started < 20


def test_idle_stream_sends_heartbeats(app: FastAPI, session: Session, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from api.routes import events

    monkeypatch.setattr(events, "HEARTBEAT_S", 0.3)
    job = add_job(session, "alice", JobStatus.running)

    async def first_chunks() -> list[str]:
        stream = events.event_stream(app.state.sessionmaker, job.id, 0, JobWakeups(), SharedReads())
        chunks = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return chunks

    assert asyncio.run(first_chunks()) == [": ping\n\n", ": ping\n\n"]


def test_kind_filter_replays_only_those_kinds_and_still_ends(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    write_a_run(session, job, metrics=3)
    auth = keys.auth(keys.alice)
    events = parse_sse(client.get(f"/v1/jobs/{job.id}/events?kind=status", headers=auth))
    assert [(e["id"], e["data"]["status"]) for e in events] == [(1, "running"), (8, "succeeded")]
    both = parse_sse(client.get(f"/v1/jobs/{job.id}/events?kind=status&kind=metric", headers=auth))
    assert [e["event"] for e in both] == ["status", "metric", "metric", "metric", "status"]
    bad = client.get(f"/v1/jobs/{job.id}/events?kind=nonsense", headers=auth)
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "kind.0"
