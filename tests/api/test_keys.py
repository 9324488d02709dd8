"""Key lifecycle over HTTP: admins list, create (with an expiry) and revoke keys; use is recorded."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.main import create_app
from service_core.db.base import utcnow
from service_core.keys import create_api_key
from service_core.settings import Settings
from tests.api.conftest import Keys


@pytest.fixture
def uncached(settings: Settings, keys: Keys) -> Iterator[TestClient]:
    """An app that asks the database on every request (a revocation shows at once)."""
    with TestClient(create_app(settings.model_copy(update={"auth_cache_seconds": 0}))) as client:
        yield client


def test_admin_creates_lists_and_revokes_keys(uncached: TestClient, keys: Keys) -> None:
    admin = keys.auth(keys.admin)
    created = uncached.post("/v1/keys", json={"owner": "carol", "expires_in_days": 30}, headers=admin)
    assert created.status_code == 201, created.text
    body = created.json()
    assert body["owner"] == "carol" and not body["is_admin"] and body["key"].startswith(body["prefix"])
    assert 29.9 < _days_left(body) <= 30
    assert uncached.get("/v1/jobs", headers=Keys.auth(body["key"])).status_code == 200
    listed = {k["id"]: k for k in uncached.get("/v1/keys", headers=admin).json()["items"]}
    assert "key" not in listed[body["id"]] and listed[body["id"]]["last_used_at"] is not None
    assert {k["owner"] for k in listed.values()} == {"root", "alice", "bob", "carol"}
    revoked = uncached.delete(f"/v1/keys/{body['id']}", headers=admin)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert uncached.get("/v1/jobs", headers=Keys.auth(body["key"])).status_code == 401
    assert uncached.delete(f"/v1/keys/{body['id']}", headers=admin).status_code == 200  # idempotent
    assert uncached.delete("/v1/keys/nope", headers=admin).status_code == 404


def _days_left(key: dict[str, str]) -> float:
    return (datetime.fromisoformat(key["expires_at"]) - utcnow()).total_seconds() / 86400


def test_only_admins_manage_keys(client: TestClient, keys: Keys) -> None:
    alice = keys.auth(keys.alice)
    assert client.get("/v1/keys", headers=alice).status_code == 403
    assert client.post("/v1/keys", json={"owner": "alice", "admin": True}, headers=alice).status_code == 403
    assert client.delete("/v1/keys/x", headers=alice).status_code == 403
    assert client.get("/v1/keys").status_code == 401
    bad = client.post("/v1/keys", json={"owner": "../etc"}, headers=keys.auth(keys.admin))
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "owner"


def test_an_expired_key_is_401(client: TestClient, session: Session, settings: Settings) -> None:
    expired = create_api_key(session, "dave", settings=settings, expires_at=utcnow() - timedelta(seconds=1))
    valid = create_api_key(session, "dave", settings=settings, expires_at=utcnow() + timedelta(days=1))
    session.commit()
    assert client.get("/v1/jobs", headers=Keys.auth(expired)).status_code == 401
    assert client.get("/v1/jobs", headers=Keys.auth(valid)).status_code == 200
