"""The OpenAPI document says what the server accepts, and the server answers what it documents
(the fixes schemathesis led to, issue 15; tests/api/test_schema_fuzz.py fuzzes the whole of it)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.schemas.jobs import CURSOR_PATTERN
from service_core.status import JobStatus
from tests.api.conftest import Keys, add_job

pytestmark = pytest.mark.both_databases

HUGE = str(10**20)  # past a BIGINT and off_t: these were OverflowErrors, a 500


@pytest.mark.parametrize(
    ("path", "allow"),
    [("/v1/jobs", "GET, POST"), ("/v1/datasets", "GET, POST"), ("/v1/keys", "GET, POST")],
)
def test_unsupported_method_lists_every_method_of_the_path(
    client: TestClient, keys: Keys, path: str, allow: str
) -> None:
    # Starlette named only the first route matching the path (`Allow: POST` for /v1/jobs).
    for method in ("OPTIONS", "PUT", "PATCH"):
        response = client.request(method, path, headers=keys.auth(keys.alice))
        assert response.status_code == 405, (method, response.text)
        assert response.headers["allow"] == allow
        assert response.headers["content-type"] == "application/problem+json"


def test_unparseable_bodies_are_a_documented_400(app: FastAPI, client: TestClient, keys: Keys) -> None:
    document = app.openapi()
    with_body = [
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
        if "requestBody" in operation
    ]
    assert {("POST", "/v1/jobs"), ("POST", "/v1/keys"), ("POST", "/v1/datasets")} <= set(with_body)
    for method, path in with_body:
        assert "400" in document["paths"][path][method.lower()]["responses"], (method, path)
    without_body = document["paths"]["/v1/jobs"]["get"]["responses"]
    assert "400" not in without_body
    headers = {**keys.auth(keys.alice), "Content-Type": "application/json"}
    response = client.post("/v1/estimates/memory", content=b"\xc9\xfd\x00{", headers=headers)
    assert response.status_code == 400 and response.headers["content-type"] == "application/problem+json"


def test_cursor_is_exactly_its_documented_pattern(client: TestClient, keys: Keys, session: Session) -> None:
    for name in ("a", "b", "c"):
        add_job(session, "alice", JobStatus.queued, name=name)
    first = client.get("/v1/jobs", params={"limit": 1}, headers=keys.auth(keys.alice)).json()
    cursor = first["next_cursor"]
    assert re.fullmatch(CURSOR_PATTERN, cursor), cursor
    second = client.get("/v1/jobs", params={"limit": 1, "cursor": cursor}, headers=keys.auth(keys.alice)).json()
    assert [j["name"] for j in first["items"] + second["items"]] == ["c", "b"]
    # Any string of the pattern is a position: one before every job is an empty page, not an error.
    oldest = client.get("/v1/jobs", params={"cursor": "0-" + "0" * 32}, headers=keys.auth(keys.alice))
    assert oldest.status_code == 200 and oldest.json()["items"] == []
    # An empty cursor matched no rule before (a 422 for a string the schema allowed); now the schema refuses it.
    for bad in ("", "!!", "1-XYZ", "1" * 18 + "-" + "0" * 32):
        response = client.get("/v1/jobs", params={"cursor": bad}, headers=keys.auth(keys.alice))
        assert response.status_code == 422 and response.json()["errors"][0]["field"] == "cursor", bad


def test_documented_patterns_and_bounds(app: FastAPI) -> None:
    paths: dict[str, Any] = app.openapi()["paths"]
    jobs_params = {p["name"]: p for p in paths["/v1/jobs"]["get"]["parameters"]}
    assert jobs_params["cursor"]["schema"]["anyOf"][0]["pattern"] == CURSOR_PATTERN
    event_params = {p["name"]: p for p in paths["/v1/jobs/{job_id}/events"]["get"]["parameters"]}
    assert event_params["Last-Event-ID"]["schema"]["pattern"] == "^[0-9]{1,18}$"
    upload = paths["/v1/datasets"]["post"]["requestBody"]["content"]["multipart/form-data"]
    disposition = upload["encoding"]["file"]["headers"]["Content-Disposition"]
    assert re.search(disposition["schema"]["pattern"], disposition["example"])
    for name in ("x.csv", "x.jsonl", "x.json", "x.parquet", "x.zip"):
        assert re.search(disposition["schema"]["pattern"], f'form-data; name="file"; filename="{name}"')
    for name in ("x", "x.txt", ".csv", "a/.csv"):
        assert not re.search(disposition["schema"]["pattern"], f'form-data; name="file"; filename="{name}"')
    # The submit examples work as they stand: none names an uploaded dataset that does not exist.
    examples = app.openapi()["components"]["schemas"]["JobCreate"]["examples"]
    assert examples and all("id" not in example["dataset"] for example in examples)


def test_numbers_past_int64_are_422_not_500(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.succeeded)
    auth = keys.auth(keys.alice)
    for path, params in [
        (f"/v1/jobs/{job.id}/logs", {"offset": HUGE}),
        (f"/v1/jobs/{job.id}/metrics", {"after": HUGE}),
        (f"/v1/jobs/{job.id}/events", {"after": HUGE}),
    ]:
        response = client.get(path, params=params, headers=auth)
        assert response.status_code == 422, (path, response.text)
        assert response.json()["errors"][0]["field"] in params


@pytest.mark.parametrize("value", [b"\xb2", b"1\xb9", HUGE.encode(), b"-1", b"1.5", b""])
def test_last_event_id_must_be_ascii_digits(client: TestClient, keys: Keys, session: Session, value: bytes) -> None:
    # Header bytes are latin-1: b"\xb2" is "²", whose str.isdigit() is True while int("²") raises (a 500).
    job = add_job(session, "alice", JobStatus.succeeded)
    headers: dict[str, Any] = {**keys.auth(keys.alice), "Last-Event-ID": value}
    response = client.get(f"/v1/jobs/{job.id}/events", headers=headers)
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "last-event-id"
