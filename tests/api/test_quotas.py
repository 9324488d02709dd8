"""Per-owner quotas: submit and upload rates, jobs waiting in the queue; 429 with Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

import api.quotas as quotas_module
from api.main import create_app
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec

pytestmark = pytest.mark.both_databases


@pytest.fixture
def limited(settings: Settings, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    # The buckets' clock stands still: on a busy machine three submits (each with its preflight) can
    # take 20 s, in which a bucket of 3 a minute would earn a token back and let the fourth through.
    monkeypatch.setattr(quotas_module, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    quotas = {"submits_per_minute": 3, "uploads_per_minute": 1, "max_queued_per_owner": 0}
    with TestClient(create_app(settings.model_copy(update=quotas))) as client:
        yield client


def assert_429(response: Any, setting: str) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert int(response.headers["Retry-After"]) >= 1
    assert setting in response.json()["detail"]


def test_submit_rate_per_owner(limited: TestClient, keys: Keys) -> None:
    for _ in range(3):
        assert limited.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)).status_code == 201
    assert_429(
        limited.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)), "TRAINJOBS_SUBMITS_PER_MINUTE"
    )
    # Another owner has a budget of its own; reads are not limited.
    assert limited.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.bob)).status_code == 201
    assert limited.get("/v1/jobs", headers=keys.auth(keys.alice)).status_code == 200


def test_upload_rate_per_owner(limited: TestClient, keys: Keys) -> None:
    files = {"file": ("r.csv", b"text,label\na,1\n")}
    assert limited.post("/v1/datasets", files=files, headers=keys.auth(keys.alice)).status_code == 201
    assert_429(limited.post("/v1/datasets", files=files, headers=keys.auth(keys.alice)), "TRAINJOBS_UPLOADS_PER_MINUTE")


def test_queued_jobs_per_owner(settings: Settings, keys: Keys) -> None:
    with TestClient(create_app(settings.model_copy(update={"max_queued_per_owner": 2}))) as client:
        ids = [client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)).json()["id"] for _ in range(2)]
        over = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
        assert_429(over, "TRAINJOBS_MAX_QUEUED_PER_OWNER")
        assert len(client.get("/v1/jobs", headers=keys.auth(keys.alice)).json()["items"]) == 2
        assert client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.bob)).status_code == 201
        # A cancelled job leaves the queue, and with it the quota.
        assert client.post(f"/v1/jobs/{ids[0]}/cancel", headers=keys.auth(keys.alice)).status_code == 202
        assert client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)).status_code == 201
