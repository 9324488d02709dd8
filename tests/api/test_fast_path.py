"""The fast paths of submit and estimate (api/fast_path.py): they serve the usual request without
FastAPI's dependency solving, answer it as FastAPI's route does, and leave every other request to it."""

from __future__ import annotations

import json
from typing import Any

import fastapi.routing
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.fast_path import FastPath
from api.main import create_app
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec

SUBMIT, ESTIMATE, ESTIMATE_FIRST_NAME = "/v1/jobs", "/v1/estimates", "/v1/estimates/memory"
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def solved(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths of the requests FastAPI's own route handler solved dependencies for."""
    paths: list[str] = []
    real = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kwargs: Any) -> Any:
        paths.append(kwargs["request"].url.path)
        return await real(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    return paths


def without_fast_paths(settings: Settings) -> FastAPI:
    app = create_app(settings)
    app.router.routes[:] = [route for route in app.router.routes if not isinstance(route, FastPath)]
    return app


def post(client: TestClient, path: str, body: Any, key: str, **headers: str) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={**JSON, "Authorization": f"Bearer {key}", **headers})


def test_usual_requests_skip_fastapis_dependency_solving(client: TestClient, keys: Keys, solved: list[str]) -> None:
    answers = [
        post(client, ESTIMATE, {"spec": make_spec()}, keys.alice),
        post(client, ESTIMATE_FIRST_NAME, {"spec": make_spec(), "gpu_memory_gb": 8}, keys.alice),
        post(client, SUBMIT, make_spec(), keys.alice),
        post(client, SUBMIT, make_spec(), keys.alice, **{"Idempotency-Key": "k-1"}),
        post(client, SUBMIT, make_spec(), keys.alice, **{"Content-Type": "application/merge-patch+json"}),
    ]
    assert [a.status_code for a in answers] == [200, 200, 201, 201, 201], [a.text for a in answers]
    assert solved == []
    # The first answer to a key again, by the fast path too (the endpoint's own JSONResponse)
    replay = post(client, SUBMIT, make_spec(), keys.alice, **{"Idempotency-Key": "k-1"})
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.json()["id"] == answers[3].json()["id"] and solved == []


def test_other_requests_go_to_fastapis_route(client: TestClient, keys: Keys, solved: list[str]) -> None:
    declined = [
        post(client, ESTIMATE, {"spec": make_spec(), "gpu_memory_gb": -1}, keys.alice),  # a body that fails
        post(client, SUBMIT + "?dry_run=true", make_spec(), keys.alice),  # a query string
        post(client, SUBMIT, make_spec(), keys.alice, **{"Idempotency-Key": "not visible ascii"}),
        post(client, SUBMIT, make_spec(), keys.alice, **{"Content-Type": "text/plain"}),
        post(client, SUBMIT, b"", keys.alice),
    ]
    assert [a.status_code for a in declined] == [422, 200, 422, 422, 422], [a.text for a in declined]
    assert solved == [ESTIMATE, SUBMIT, SUBMIT, SUBMIT, SUBMIT]


def test_answers_are_fastapis_answers(settings: Settings, client: TestClient, keys: Keys) -> None:
    """Each request to both apps, with and without the fast paths, gets the same answer."""
    spec = make_spec()
    requests: list[tuple[str, Any, dict[str, str]]] = [
        (ESTIMATE, {"spec": spec}, {}),
        (ESTIMATE_FIRST_NAME, {"spec": spec, "gpu_memory_gb": 2, "devices": 1}, {}),
        # errors, each named as FastAPI names it: lax JSON types, an unknown field, a non-finite number,
        # a body that is not JSON, a cross-field rule, a body over the document bounds
        (ESTIMATE, {"spec": make_spec(training={"max_steps": "4"})}, {}),
        (ESTIMATE, {"spec": make_spec(training={"fp16": 1})}, {}),
        (ESTIMATE, {"spec": spec, "gpu_memory": 8}, {}),
        (ESTIMATE, b'{"spec": %s, "gpu_memory_gb": NaN}' % json.dumps(spec).encode(), {}),
        (ESTIMATE, b'{"spec": ', {}),
        (ESTIMATE, {"spec": make_spec(efficiency={"local_sgd_steps": 4})}, {}),
        (SUBMIT, make_spec(training={"max_steps": True}), {}),
        (SUBMIT, make_spec(name="x\u0000y"), {}),
        (SUBMIT, make_spec(dataset={"path": "csv", "data_files": {"train": "reviews/missing.csv"}}), {}),
        (SUBMIT, [spec], {}),
    ]
    plain = TestClient(without_fast_paths(settings))
    with plain:
        for path, body, headers in requests:
            fast, slow = post(client, path, body, keys.alice, **headers), post(plain, path, body, keys.alice, **headers)
            assert (fast.status_code, fast.headers["content-type"]) == (slow.status_code, slow.headers["content-type"])
            assert fast.json() == slow.json(), (path, body)
        # A submit: the same job apart from what makes each one itself
        fast, slow = post(client, SUBMIT, spec, keys.alice), post(plain, SUBMIT, spec, keys.alice)
        assert fast.status_code == slow.status_code == 201
        assert fast.headers["location"] == f"/v1/jobs/{fast.json()['id']}"
        assert same_job(fast.text, fast.json()) == same_job(slow.text, slow.json())


def same_job(text: str, job: dict[str, Any]) -> dict[str, Any]:
    """A submit's answer without what makes each job itself: its id (in its links too) and its times."""
    times = ("created_at", "enqueued_at", "updated_at")
    return {k: v for k, v in json.loads(text.replace(job["id"], "ID")).items() if k not in times}
