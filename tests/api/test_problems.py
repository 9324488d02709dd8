"""Errors are problem+json naming the field to fix; bad input is 4xx, never 500."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.api.conftest import Keys, make_spec


def submit(client: TestClient, keys: Keys, body: object) -> dict[str, object]:
    response = client.post("/v1/jobs", json=body, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["status"] == 422 and problem["title"]
    return problem


def fields(problem: dict[str, object]) -> list[str]:
    errors = problem["errors"]
    assert isinstance(errors, list)
    return [e["field"] for e in errors]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        # a cross-field rule: pydantic reports it on the model, the API names the real field
        (
            {"efficiency": {"local_sgd_steps": 4}, "training": {"backend": "trainer"}},
            "efficiency.local_sgd_steps",
        ),
        ({"optimizer": {"name": "sgd"}}, "optimizer.name"),
        ({"optimizer": {"name": "adafactor", "adam_beta1": 0.8}}, "optimizer.adam_beta1"),
        ({"training": {"learning_rate": -1}}, "training.learning_rate"),
        ({"colour": "blue"}, "colour"),
        ({"priority": 42}, "priority"),
        ({"queue": "../etc"}, "queue"),
    ],
)
def test_spec_errors_name_the_field(client: TestClient, keys: Keys, overrides: dict[str, object], field: str) -> None:
    problem = submit(client, keys, make_spec(**overrides))
    assert field in fields(problem)
    assert field in str(problem["detail"])


def test_missing_required_field_and_wrong_shape(client: TestClient, keys: Keys) -> None:
    spec = make_spec()
    del spec["task"]
    assert fields(submit(client, keys, spec)) == ["task"]
    assert "dataset.path" in fields(submit(client, keys, make_spec(dataset={"data_files": "a.csv"})))


def test_malformed_json_is_422_not_500(client: TestClient, keys: Keys) -> None:
    response = client.post(
        "/v1/jobs",
        content=b"{not json",
        headers={**keys.auth(keys.alice), "Content-Type": "application/json"},
    )
    assert response.status_code == 422
    assert response.headers["content-type"] == "application/problem+json"


def test_unknown_route_is_problem_404(client: TestClient, keys: Keys) -> None:
    # Without a key every /v1/ path is a 401: the key is checked before routing (api/auth.py).
    assert client.get("/v1/nothing-here").status_code == 401
    response = client.get("/v1/nothing-here", headers=keys.auth(keys.alice))
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["status"] == 404


def test_unexpected_error_is_a_problem_without_internals(app: FastAPI) -> None:
    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("secret internals")

    with TestClient(app, raise_server_exceptions=False) as test_client:
        response = test_client.get("/boom")
    assert response.status_code == 500
    assert response.headers["content-type"] == "application/problem+json"
    assert "secret internals" not in response.text
