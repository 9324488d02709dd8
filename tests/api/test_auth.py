"""API keys: stored hashed, bootstrap admin key, revocation."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.auth import KeyCache
from api.main import create_app
from service_core.db.models import ApiKey
from service_core.keys import Caller, authenticate, create_api_key, hash_key
from service_core.settings import Settings
from tests.api.conftest import Keys


def test_keys_are_stored_as_hmac_only(session: Session, settings: Settings) -> None:
    key = create_api_key(session, "carol", settings=settings)
    session.commit()
    row = session.execute(select(ApiKey).where(ApiKey.owner == "carol")).scalar_one()
    assert row.key_hash == hash_key(key, settings.secret_key) != key
    assert key not in (row.key_hash, row.prefix) and key.startswith(row.prefix)
    caller = authenticate(session, key, settings.secret_key)
    assert caller is not None and (caller.owner, caller.is_admin) == ("carol", False)
    # the same key under another secret is a different hash: a stolen table is useless elsewhere
    assert authenticate(session, key, settings.secret_key + "x") is None


def test_owner_names_are_restricted(session: Session, settings: Settings) -> None:
    with pytest.raises(ValueError, match="owner"):
        create_api_key(session, "../evil", settings=settings)


def revoke(session: Session, key: str, settings: Settings) -> None:
    row = session.execute(select(ApiKey).where(ApiKey.key_hash == hash_key(key, settings.secret_key))).scalar_one()
    row.revoked_at = datetime.now(UTC)
    session.commit()


def test_revoked_key_is_401_at_once_without_the_cache(keys: Keys, session: Session, settings: Settings) -> None:
    with TestClient(create_app(settings.model_copy(update={"auth_cache_seconds": 0.0}))) as client:
        assert client.get("/v1/jobs", headers=keys.auth(keys.bob)).status_code == 200
        revoke(session, keys.bob, settings)
        assert client.get("/v1/jobs", headers=keys.auth(keys.bob)).status_code == 401


def test_revoked_key_is_401_once_the_cached_check_expires(keys: Keys, session: Session, settings: Settings) -> None:
    ttl = 1.0
    with TestClient(create_app(settings.model_copy(update={"auth_cache_seconds": ttl}))) as client:
        # The warm-up imports (torch) hold the GIL for seconds on a busy machine: past them, the
        # first request does not outlast the TTL it starts.
        client.app.state.warmed_up.wait(120)  # type: ignore[attr-defined]
        assert client.get("/v1/jobs", headers=keys.auth(keys.bob)).status_code == 200
        revoked_at = time.monotonic()
        revoke(session, keys.bob, settings)
        # Within the TTL the process trusts its earlier check (no database round trip)...
        assert client.get("/v1/jobs", headers=keys.auth(keys.bob)).status_code == 200
        # ...an unknown key is never cached...
        assert client.get("/v1/jobs", headers=keys.auth(keys.bob + "x")).status_code == 401
        time.sleep(max(0.0, revoked_at + ttl + 0.05 - time.monotonic()))
        # ...and after it the revocation holds.
        assert client.get("/v1/jobs", headers=keys.auth(keys.bob)).status_code == 401
        assert client.get("/v1/jobs", headers=keys.auth(keys.alice)).status_code == 200


def test_key_cache_is_bounded_and_expires() -> None:
    cache = KeyCache(ttl=60, max_entries=3)
    callers = [Caller(owner=f"o{i}", is_admin=False, key_id=str(i)) for i in range(4)]
    for i, caller in enumerate(callers[:3]):
        cache.put(f"h{i}", caller)
    assert cache.get("h2") == callers[2]
    cache.put("h3", callers[3])  # full: starts over
    assert (cache.get("h0"), cache.get("h3")) == (None, callers[3])
    expired = KeyCache(ttl=0.01)
    expired.put("h", callers[0])
    time.sleep(0.02)
    assert expired.get("h") is None
    disabled = KeyCache(ttl=0)
    disabled.put("h", callers[0])
    assert disabled.get("h") is None


def test_non_bearer_authorization_is_401(client: TestClient, keys: Keys) -> None:
    response = client.get("/v1/jobs", headers={"Authorization": f"Basic {keys.alice}"})
    assert response.status_code == 401
    assert response.headers["content-type"] == "application/problem+json"


def test_bootstrap_key_from_settings_is_an_admin_key(settings: Settings, session: Session) -> None:
    configured = settings.model_copy(update={"api_key": "tj_known-bootstrap-key"})
    for _ in range(2):  # a restart registers nothing twice
        with TestClient(create_app(configured)) as test_client:
            response = test_client.get("/v1/jobs", headers=Keys.auth("tj_known-bootstrap-key"))
            assert response.status_code == 200
    rows = session.execute(select(ApiKey)).scalars().all()
    assert [(r.owner, r.is_admin) for r in rows] == [("admin", True)]


def test_production_refuses_default_secret(settings: Settings) -> None:
    unsafe = settings.model_copy(update={"env": "production", "secret_key": "short", "api_key": None})
    with pytest.raises(RuntimeError, match="TRAINJOBS_SECRET_KEY"):
        create_app(unsafe)
