"""``POST /v1/jobs/{id}/pause`` and ``/resume`` at the API: the moves, the refusals, the quotas.

The worker's side (a running job checkpoints, becomes paused, and resumes with the exact curve) is
tests/trainjobs/test_pause_resume.py, through a live service.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from service_core.db.models import Job, JobEvent
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus

from .conftest import Keys, add_job, make_spec


def status_events(session: Session, job_id: str) -> list[dict[str, Any]]:
    session.expire_all()
    rows = select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "status").order_by(JobEvent.seq)
    return [dict(data) for data in session.execute(rows).scalars()]


def test_a_queued_job_pauses_at_once_and_resumes_onto_its_queue(
    app: FastAPI, client: TestClient, keys: Keys, session: Session
) -> None:
    sent: list[tuple[str, str, int]] = []
    app.state.enqueue = lambda job_id, queue, priority, settings: sent.append((job_id, queue, priority))
    job = add_job(session, "alice", queue="gpu-a", priority=7)
    paused = client.post(f"/v1/jobs/{job.id}/pause", headers=keys.auth(keys.alice))
    assert paused.status_code == 202
    body = paused.json()
    assert (body["status"], body["finished_at"], body["error"]) == ("paused", None, None)
    assert body["pause_requested"] is False
    assert status_events(session, job.id)[-1] == {
        "status": "paused", "previous": "queued", "reason": ErrorReason.paused, "message": "paused by alice"
    }  # fmt: skip

    # Paused again: nothing changes (and nothing is sent).
    assert client.post(f"/v1/jobs/{job.id}/pause", headers=keys.auth(keys.alice)).json()["status"] == "paused"
    resumed = client.post(f"/v1/jobs/{job.id}/resume", headers=keys.auth(keys.alice))
    assert resumed.status_code == 202 and resumed.json()["status"] == "queued"
    assert sent == [(job.id, "gpu-a", 7)]  # back on its own queue, at its priority
    resume_event = {"status": "queued", "previous": "paused", "message": "resumed by alice"}
    assert status_events(session, job.id)[-1] == resume_event

    again = client.post(f"/v1/jobs/{job.id}/resume", headers=keys.auth(keys.alice))
    assert again.status_code == 409 and again.json()["job_status"] == "queued"
    assert sent == [(job.id, "gpu-a", 7)]


def test_a_running_job_is_asked_to_pause(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.running)
    response = client.post(f"/v1/jobs/{job.id}/pause", headers=keys.auth(keys.alice))
    assert response.status_code == 202
    assert (response.json()["status"], response.json()["pause_requested"]) == ("running", True)
    session.expire_all()
    assert session.get(Job, job.id).pause_requested is True  # type: ignore[union-attr]  # the slot's cue
    not_paused = client.post(f"/v1/jobs/{job.id}/resume", headers=keys.auth(keys.alice))
    assert not_paused.status_code == 409 and not_paused.json()["job_status"] == "running"


def test_an_ended_or_cancelling_job_cannot_pause(client: TestClient, keys: Keys, session: Session) -> None:
    for status in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled):
        job = add_job(session, "alice", status)
        response = client.post(f"/v1/jobs/{job.id}/pause", headers=keys.auth(keys.alice))
        assert response.status_code == 409, status
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["job_status"] == status.value
    cancelling = add_job(session, "alice", JobStatus.running, cancel_requested=True)
    response = client.post(f"/v1/jobs/{cancelling.id}/pause", headers=keys.auth(keys.alice))
    assert response.status_code == 409 and "being cancelled" in response.json()["detail"]


def test_another_owners_job_is_not_found(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    for action in ("pause", "resume"):
        assert client.post(f"/v1/jobs/{job.id}/{action}", headers=keys.auth(keys.bob)).status_code == 404
        assert client.post(f"/v1/jobs/nope/{action}", headers=keys.auth(keys.alice)).status_code == 404
    session.expire_all()
    assert session.get(Job, job.id).status == "queued"  # type: ignore[union-attr]


def test_a_paused_job_cancels_at_once(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.paused)
    response = client.post(f"/v1/jobs/{job.id}/cancel", headers=keys.auth(keys.alice))
    assert response.status_code == 202
    assert (response.json()["status"], response.json()["error"]["reason"]) == ("cancelled", ErrorReason.cancelled)
    assert client.post(f"/v1/jobs/{job.id}/resume", headers=keys.auth(keys.alice)).status_code == 409


def test_a_paused_job_is_outside_the_queued_quota_until_it_resumes(
    settings: Settings, keys: Keys, session: Session
) -> None:
    from api.main import create_app

    capped = settings.model_copy(update={"max_queued_per_owner": 1})
    app = create_app(capped)
    app.state.enqueue = lambda *args: None
    with TestClient(app) as client:
        first = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
        assert first.status_code == 201
        assert client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)).status_code == 429
        assert client.post(f"/v1/jobs/{first.json()['id']}/pause", headers=keys.auth(keys.alice)).status_code == 202
        second = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
        assert second.status_code == 201  # the paused job no longer holds the place
        refused = client.post(f"/v1/jobs/{first.json()['id']}/resume", headers=keys.auth(keys.alice))
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        assert client.get(f"/v1/jobs/{first.json()['id']}", headers=keys.auth(keys.alice)).json()["status"] == "paused"
