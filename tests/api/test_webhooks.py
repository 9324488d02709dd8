"""``/v1/webhooks``: create, list, show, delete, rotate, deliveries and redelivery; owner isolation on
each; bad input is a 422 naming the field. Deliveries come from real job events (the job store), and
from a submit through the API."""

from __future__ import annotations

import base64

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from service_core.db.jobstore import transition
from service_core.db.models import Webhook, WebhookDelivery
from service_core.status import JobStatus
from service_core.webhooks import EVENT_TYPES
from tests.api.conftest import Keys, add_job, make_spec

pytestmark = pytest.mark.both_databases

# A name nobody resolves (the .test TLD is reserved): it passes the public-address rule at creation.
URL = "https://hooks.example.test/trainjobs"
PUBLIC_FIELDS = {"id", "owner", "url", "events", "description", "enabled", "disabled_reason", "created_at"}


def create(client: TestClient, key: str, **body: object) -> dict[str, object]:
    payload = {"url": URL, "events": ["job.succeeded", "job.failed"], "description": "ci", **body}
    response = client.post("/v1/webhooks", json=payload, headers=Keys.auth(key))
    assert response.status_code == 201, response.text
    created: dict[str, object] = response.json()
    return created


def test_create_shows_the_secret_once(client: TestClient, keys: Keys) -> None:
    hook = create(client, keys.alice)
    assert set(hook) == PUBLIC_FIELDS | {"secret"}
    assert hook["owner"] == "alice" and hook["url"] == URL and hook["enabled"] is True
    assert hook["events"] == ["job.succeeded", "job.failed"] and hook["disabled_reason"] is None
    secret = str(hook["secret"])
    assert secret.startswith("whsec_") and len(base64.b64decode(secret.removeprefix("whsec_"))) >= 24
    shown = client.get(f"/v1/webhooks/{hook['id']}", headers=keys.auth(keys.alice))
    assert shown.status_code == 200 and set(shown.json()) == PUBLIC_FIELDS
    listed = client.get("/v1/webhooks", headers=keys.auth(keys.alice)).json()["items"]
    assert [item["id"] for item in listed] == [hook["id"]] and "secret" not in listed[0]


def test_rotate_gives_a_new_secret(client: TestClient, keys: Keys, session: Session) -> None:
    hook = create(client, keys.alice)
    rotated = client.post(f"/v1/webhooks/{hook['id']}/rotate-secret", headers=keys.auth(keys.alice))
    assert rotated.status_code == 200
    assert rotated.json()["secret"] != hook["secret"] and rotated.json()["secret"].startswith("whsec_")
    assert session.execute(select(Webhook.secret)).scalar_one() == rotated.json()["secret"]


def test_delete(client: TestClient, keys: Keys) -> None:
    hook = create(client, keys.alice)
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=keys.auth(keys.alice)).status_code == 204
    assert client.get(f"/v1/webhooks/{hook['id']}", headers=keys.auth(keys.alice)).status_code == 404
    assert client.delete(f"/v1/webhooks/{hook['id']}", headers=keys.auth(keys.alice)).status_code == 404


def test_another_owners_webhook_is_not_found(client: TestClient, keys: Keys, session: Session) -> None:
    hook = create(client, keys.alice)
    job = add_job(session, "alice", JobStatus.running)
    transition(session, job.id, JobStatus.succeeded)
    session.commit()
    delivery = session.execute(select(WebhookDelivery.id)).scalar_one()
    bob = keys.auth(keys.bob)
    base = f"/v1/webhooks/{hook['id']}"
    redeliver = f"{base}/deliveries/{delivery}/redeliver"
    for method, path in [("GET", base), ("DELETE", base), ("POST", f"{base}/rotate-secret"),
                         ("GET", f"{base}/deliveries"), ("POST", redeliver)]:  # fmt: skip
        response = client.request(method, path, headers=bob)
        assert response.status_code == 404, (method, path, response.text)
        assert response.headers["content-type"].startswith("application/problem+json")
    assert client.get("/v1/webhooks", headers=bob).json()["items"] == []
    admin = client.get("/v1/webhooks", headers=keys.auth(keys.admin)).json()["items"]
    assert [item["owner"] for item in admin] == ["alice"]
    assert client.get(base, headers=keys.auth(keys.admin)).status_code == 200


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"events": ["job.succeeded", "job.exploded"]}, "events.1"),
        ({"events": []}, "events"),
        ({"url": "http://127.0.0.1:8080/hook"}, "url"),
        ({"url": "http://169.254.169.254/latest"}, "url"),
        ({"url": "http://metadata.google.internal/"}, "url"),
        ({"url": "http://localhost/hook"}, "url"),
        ({"url": "ftp://example.com/hook"}, "url"),
        ({"url": "https://user:pw@example.com/hook"}, "url"),
        ({"url": "not a url"}, "url"),
        ({"description": "x" * 501}, "description"),
    ],
)
def test_bad_input_is_a_422_naming_the_field(
    client: TestClient, keys: Keys, body: dict[str, object], field: str
) -> None:
    payload = {"url": URL, "events": ["job.succeeded"], **body}
    response = client.post("/v1/webhooks", json=payload, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert [error["field"] for error in response.json()["errors"]] == [field]


def test_the_schema_lists_the_event_types(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["WebhookCreate"]["properties"]["events"]["items"]["enum"] == list(EVENT_TYPES)


def test_deliveries_newest_first_and_redelivery(client: TestClient, keys: Keys, session: Session) -> None:
    hook = create(client, keys.alice, events=list(EVENT_TYPES))
    job = add_job(session, "alice", name="sentiment")
    transition(session, job.id, JobStatus.running)
    session.commit()
    transition(session, job.id, JobStatus.failed, message="boom")
    session.commit()
    auth = keys.auth(keys.alice)
    items = client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth).json()["items"]
    assert [item["event_type"] for item in items] == ["job.failed", "job.running"]
    newest = items[0]
    assert newest["state"] == "pending" and newest["attempts"] == 0 and newest["attempt_log"] == []
    assert newest["job_id"] == job.id and newest["payload"]["data"]["message"] == "boom"
    assert newest["payload"]["data"]["name"] == "sentiment"
    assert len(client.get(f"/v1/webhooks/{hook['id']}/deliveries?limit=1", headers=auth).json()["items"]) == 1
    again = client.post(f"/v1/webhooks/{hook['id']}/deliveries/{newest['id']}/redeliver", headers=auth)
    assert again.status_code == 202, again.text
    fresh = again.json()
    assert fresh["id"] != newest["id"] and fresh["payload"] == newest["payload"]
    assert fresh["state"] == "pending" and fresh["attempts"] == 0 and fresh["event_type"] == "job.failed"
    assert len(client.get(f"/v1/webhooks/{hook['id']}/deliveries", headers=auth).json()["items"]) == 3
    missing = client.post(f"/v1/webhooks/{hook['id']}/deliveries/nope/redeliver", headers=auth)
    assert missing.status_code == 404


def test_a_submit_queues_a_job_queued_delivery(client: TestClient, keys: Keys, session: Session) -> None:
    hook = create(client, keys.alice, events=["job.queued"])
    auth = keys.auth(keys.alice)
    plain = client.post("/v1/jobs", json=make_spec(), headers=auth).json()
    keyed = client.post("/v1/jobs", json=make_spec(), headers={**auth, "Idempotency-Key": "k-1"}).json()
    create(client, keys.bob, events=["job.queued"])  # bob's webhook sees none of alice's jobs
    rows = session.execute(select(WebhookDelivery).order_by(WebhookDelivery.created_at)).scalars().all()
    assert [(row.webhook_id, row.job_id, row.event_type) for row in rows] == [
        (hook["id"], plain["id"], "job.queued"), (hook["id"], keyed["id"], "job.queued")
    ]  # fmt: skip
