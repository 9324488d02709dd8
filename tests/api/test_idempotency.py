"""``Idempotency-Key`` on ``POST /v1/jobs`` and ``POST /v1/datasets`` (issue 31, api/idempotency.py): the
same key from the same owner within 24 h returns the first answer and creates nothing; with another
body it is a 422 naming the header; another owner's key, an expired key or no key create anew.
The API killed between its commit and its answer: tests/trainjobs/test_idempotent_submit.py."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from api.idempotency import IDEMPOTENCY_TTL
from service_core.db.base import utcnow
from service_core.db.models import Dataset, IdempotencyKey, Job
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from tests.api.live import serve

pytestmark = pytest.mark.both_databases

CSV = b"text,label\ngreat film,1\nawful film,0\n"


def submit(client: TestClient | httpx.Client, key: str, idempotency_key: str | None, **spec: Any) -> httpx.Response:
    headers = Keys.auth(key) | ({"Idempotency-Key": idempotency_key} if idempotency_key else {})
    return client.post("/v1/jobs", json=make_spec(**spec), headers=headers)


def upload(client: TestClient, key: str, idempotency_key: str, content: bytes = CSV) -> httpx.Response:
    headers = Keys.auth(key) | {"Idempotency-Key": idempotency_key}
    return client.post("/v1/datasets", files={"file": ("reviews.csv", content)}, data={"name": "r"}, headers=headers)


def count(session: Session, model: type[Job] | type[Dataset]) -> int:
    session.expire_all()
    return session.execute(select(func.count()).select_from(model)).scalar_one()


def test_a_repeated_key_returns_the_first_answer_and_creates_nothing(
    client: TestClient, keys: Keys, session: Session
) -> None:
    first = submit(client, keys.alice, "submit-1")
    assert first.status_code == 201, first.text
    again = submit(client, keys.alice, "submit-1")
    assert again.status_code == 201
    assert again.json() == first.json() and again.headers["Location"] == first.headers["Location"]
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    assert count(session, Job) == 1


def test_a_repeated_key_with_another_body_is_422_naming_the_header(
    client: TestClient, keys: Keys, session: Session
) -> None:
    assert submit(client, keys.alice, "submit-1").status_code == 201
    other = submit(client, keys.alice, "submit-1", name="another-name")
    assert other.status_code == 422, other.text
    assert other.headers["content-type"] == "application/problem+json"
    assert [e["field"] for e in other.json()["errors"]] == ["Idempotency-Key"]
    assert count(session, Job) == 1


def test_keys_are_per_owner_and_expire_after_a_day(client: TestClient, keys: Keys, session: Session) -> None:
    alice = submit(client, keys.alice, "k").json()
    bob = submit(client, keys.bob, "k")
    assert bob.status_code == 201 and bob.json()["id"] != alice["id"]  # bob's "k" is not alice's
    session.execute(update(IdempotencyKey).values(created_at=utcnow() - IDEMPOTENCY_TTL - timedelta(minutes=1)))
    session.commit()
    later = submit(client, keys.alice, "k")
    assert later.status_code == 201 and later.json()["id"] != alice["id"]
    assert "Idempotent-Replayed" not in later.headers
    assert count(session, Job) == 3
    # The expired row was replaced by the new answer: one key row per owner and key.
    assert session.execute(select(func.count()).select_from(IdempotencyKey)).scalar_one() == 2


def test_without_a_key_every_submit_creates_a_job(client: TestClient, keys: Keys, session: Session) -> None:
    assert submit(client, keys.alice, None).json()["id"] != submit(client, keys.alice, None).json()["id"]
    assert count(session, Job) == 2


def test_a_malformed_key_is_422_naming_the_header(client: TestClient, keys: Keys, session: Session) -> None:
    for bad in ("x" * 256, "two words"):
        response = submit(client, keys.alice, bad)
        assert response.status_code == 422, response.text
        assert [e["field"] for e in response.json()["errors"]] == ["Idempotency-Key"]
    assert count(session, Job) == 0


def test_concurrent_retries_with_one_key_create_one_job(app: FastAPI, keys: Keys, session: Session) -> None:
    answers: list[httpx.Response] = []
    with serve(app) as url:

        def send() -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                answers.append(submit(http, keys.alice, "raced"))

        threads = [threading.Thread(target=send) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert [a.status_code for a in answers] == [201] * 4, [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    assert count(session, Job) == 1


def test_a_job_the_queue_refused_does_not_hold_its_key(app: FastAPI, client: TestClient, keys: Keys) -> None:
    def unreachable(*args: Any) -> None:
        raise ConnectionError("broker down")

    app.state.enqueue = unreachable
    refused = submit(client, keys.alice, "k")
    assert refused.status_code == 503
    app.state.enqueue = None  # the real one again (api/deps.py loads it)
    retried = submit(client, keys.alice, "k")  # the answer said "not started": the retry starts it
    assert retried.status_code == 201 and "Idempotent-Replayed" not in retried.headers
    assert retried.json()["status"] == "queued"


def test_a_repeated_upload_key_returns_the_first_dataset(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    first = upload(client, keys.alice, "up-1")
    assert first.status_code == 201, first.text
    again = upload(client, keys.alice, "up-1")
    assert again.status_code == 201 and again.json() == first.json()
    assert again.headers["Idempotent-Replayed"] == "true"
    assert count(session, Dataset) == 1
    assert len(list((settings.data_root / "uploads" / "alice").iterdir())) == 1  # one stored copy
    other = upload(client, keys.alice, "up-1", content=CSV + b"fine film,1\n")
    assert other.status_code == 422 and [e["field"] for e in other.json()["errors"]] == ["Idempotency-Key"]
    assert count(session, Dataset) == 1
