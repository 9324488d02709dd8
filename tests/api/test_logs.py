"""``GET /v1/jobs/{id}/logs``: the run's output by byte offset (live file, then the stored artifact) and
``follow=true`` streaming until the job ends; with the works / not found / not yours trio."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update
from sqlalchemy.orm import Session

from api.routes.logs import live_log
from service_core.db.models import Job
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.api.conftest import Keys, add_job

# Multi-byte characters on purpose: a page must never cut one in half.
TEXT = "loading data…\nstep 1 loss=0.9 ✓\nstep 2 loss=0.7 ✓\nZ\u00fcrich \U0001f680 done\n"


def write_live_log(settings: Settings, job_id: str, text: str) -> Path:
    path = live_log(settings, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def set_status(app: FastAPI, job_id: str, status: JobStatus) -> None:
    with app.state.sessionmaker() as db:
        db.execute(update(Job).where(Job.id == job_id).values(status=status.value))
        db.commit()


def test_pages_by_offset_never_split_a_character(
    app: FastAPI, client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    job = add_job(session, "alice", JobStatus.running)
    write_live_log(settings, job.id, TEXT)
    pieces, offset = [], 0
    while True:
        page = client.get(
            f"/v1/jobs/{job.id}/logs", params={"offset": offset, "limit": 16}, headers=keys.auth(keys.alice)
        )
        assert page.status_code == 200, page.text
        body = page.json()
        assert body["offset"] == offset and body["complete"] is False  # still running
        if not body["text"]:
            break
        pieces.append(body["text"])
        offset = body["next_offset"]
    assert "".join(pieces) == TEXT and offset == len(TEXT.encode())
    set_status(app, job.id, JobStatus.succeeded)
    last = client.get(f"/v1/jobs/{job.id}/logs", params={"offset": offset}, headers=keys.auth(keys.alice)).json()
    assert last == {"offset": offset, "next_offset": offset, "text": "", "complete": True}
    whole = client.get(f"/v1/jobs/{job.id}/logs", headers=keys.auth(keys.alice)).json()
    assert whole["text"] == TEXT and whole["complete"] is True


def test_a_finished_run_is_read_from_its_stored_artifact(
    app: FastAPI, client: TestClient, keys: Keys, session: Session
) -> None:
    job = add_job(session, "alice", JobStatus.failed)
    store = app.state.artifacts
    store.fs.makedirs(store.job_dir(job.id), exist_ok=True)
    with store.fs.open(f"{store.job_dir(job.id)}/worker.log", "wb") as handle:
        handle.write(TEXT.encode())
    body = client.get(f"/v1/jobs/{job.id}/logs", params={"offset": 5}, headers=keys.auth(keys.alice)).json()
    assert body["text"] == TEXT.encode()[5:].decode() and body["complete"] is True


def test_follow_streams_what_is_appended_until_the_job_ends(
    app: FastAPI, client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    job = add_job(session, "alice", JobStatus.running)
    path = write_live_log(settings, job.id, "first line\n")

    def run_on() -> None:
        time.sleep(0.8)
        with path.open("a", encoding="utf-8") as handle:
            handle.write("second line ✓\n")
        time.sleep(0.8)
        set_status(app, job.id, JobStatus.succeeded)

    writer = threading.Thread(target=run_on)
    writer.start()
    params: dict[str, str | int] = {"follow": "true", "offset": 6}
    with client.stream("GET", f"/v1/jobs/{job.id}/logs", params=params, headers=keys.auth(keys.alice)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain")
        received = b"".join(response.iter_bytes())
    writer.join()
    # The second line was written after the stream had reached the end of the file: it waited for it.
    assert received.decode() == "line\nsecond line ✓\n"


def test_a_job_with_no_output_yet_and_the_trio(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    body = client.get(f"/v1/jobs/{job.id}/logs", headers=keys.auth(keys.alice)).json()
    assert body == {"offset": 0, "next_offset": 0, "text": "", "complete": False}
    assert client.get("/v1/jobs/nope/logs", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get(f"/v1/jobs/{job.id}/logs", headers=keys.auth(keys.bob)).status_code == 404
    assert (
        client.get(f"/v1/jobs/{job.id}/logs", params={"follow": "true"}, headers=keys.auth(keys.bob)).status_code == 404
    )
    assert client.get(f"/v1/jobs/{job.id}/logs").status_code == 401
    bad = client.get(f"/v1/jobs/{job.id}/logs", params={"offset": -1}, headers=keys.auth(keys.alice))
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "offset"
