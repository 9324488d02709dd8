"""Inputs that used to reach the database or the serializer and fail there (500s) are 422s naming
the field: NUL characters anywhere, nesting past the bound; lists carry no specs. A run time limit
over the service's ceiling is a 422 naming the field too."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.spec_limits import MAX_DEPTH, document_errors, within_bounds
from service_core.db.models import Job
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec

pytestmark = pytest.mark.both_databases


def nested(levels: int) -> dict[str, Any]:
    doc: dict[str, Any] = {"leaf": 1}
    for _ in range(levels - 1):
        doc = {"a": doc}
    return doc


def refused(client: TestClient, keys: Keys, spec: dict[str, Any]) -> list[str]:
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    return [e["field"] for e in response.json()["errors"]]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"name": "tiny\u0000bert"}, "name"),
        ({"dataset": {"path": "csv", "data_files": {"train": "reviews/train\u0000.csv"}}}, "dataset.data_files.train"),
        ({"model": {"config": {"model_type": "bert", "label": "a\u0000b"}}}, "model.config.label"),
        ({"model": {"config": {"model_type": "bert", "k\u0000ey": 1}}}, "model.config.k\u0000ey"),
        ({"model": {"config": {"model_type": "bert", "ids": ["x", "y\u0000"]}}}, "model.config.ids.1"),
    ],
)
def test_nul_characters_are_422_naming_the_field(
    client: TestClient, keys: Keys, session: Session, overrides: dict[str, Any], field: str
) -> None:
    assert refused(client, keys, make_spec(**overrides)) == [field]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_deep_nesting_is_422_naming_the_field(client: TestClient, keys: Keys, session: Session) -> None:
    spec = make_spec()
    spec["model"]["config"]["extra"] = nested(254)
    fields = refused(client, keys, spec)
    assert len(fields) == 1 and fields[0].startswith("model.config.extra.a.a")
    assert len(fields[0].split(".")) == MAX_DEPTH  # the first part past the bound
    estimate = client.post("/v1/estimates/memory", json={"spec": spec}, headers=keys.auth(keys.alice))
    assert estimate.status_code == 422
    assert estimate.json()["errors"][0]["field"].startswith("spec.model.config.extra.a")
    # A realistic config nesting a few levels is fine.
    spec["model"]["config"]["extra"] = nested(5)
    assert client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice)).status_code == 201
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 1


@pytest.mark.parametrize(
    "doc",
    [
        nested(MAX_DEPTH), nested(MAX_DEPTH + 1), {"a": [[1.0, [2]]]}, [nested(MAX_DEPTH - 1)], [nested(MAX_DEPTH)],
        {"x": float("inf")}, {"x": [1.0, float("nan")]}, {"k\u0000": 1}, {"a": ["ok", "n\u0000"]}, {"a": {}, "b": []},
    ],
)  # fmt: skip
def test_the_quick_bounds_check_agrees_with_the_walk_that_names_fields(doc: Any) -> None:
    """Requests pass through the path-free check; only a document it refuses is walked for field names,
    so the two must agree at every bound (depth exactly at the limit, NULs in keys and lists, non-finite)."""
    assert within_bounds(doc) == (document_errors(doc) == [])


def test_lists_carry_no_specs_but_a_job_does(client: TestClient, keys: Keys) -> None:
    created = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["name"] == "tiny-bert"
    listed = client.get("/v1/jobs", headers=keys.auth(keys.alice)).json()["items"]
    assert [j["id"] for j in listed] == [created.json()["id"]] and "spec" not in listed[0]
    shown = client.get(f"/v1/jobs/{created.json()['id']}", headers=keys.auth(keys.alice)).json()
    assert shown["spec"]["name"] == "tiny-bert"


def test_max_job_hours_is_the_ceiling_and_the_default_of_the_run_time_limit(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    ceiling = settings.max_job_hours * 60
    assert refused(client, keys, make_spec(resources={"max_runtime_minutes": ceiling + 1})) == [
        "resources.max_runtime_minutes"
    ]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    for given, limit in ((None, ceiling), (ceiling, ceiling), (90, 90)):
        resources = {} if given is None else {"max_runtime_minutes": given}
        created = client.post("/v1/jobs", json=make_spec(resources=resources), headers=keys.auth(keys.alice))
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["resources"]["max_runtime_minutes"] == limit
