"""Memory estimates and the model catalog over HTTP; liveness and readiness."""

from __future__ import annotations

import secrets
import sys
import threading
import time
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.routes import estimates
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from trainer_core.memory import TOTAL_FORMULA, catalog_ids, estimate_memory, plan_memory
from trainer_core.spec import JobSpec

BERT_LARGE = make_spec(name="bert-large", model={"name_or_path": "bert-large-uncased"})


def test_estimate_matches_the_estimator(client: TestClient, keys: Keys) -> None:
    response = client.post("/v1/estimates/memory", json={"spec": BERT_LARGE}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    body = response.json()
    expected = estimate_memory(JobSpec.model_validate(BERT_LARGE))
    assert body["estimate"]["total_bytes"] == expected.total_bytes
    assert body["estimate"]["optimizer_state_bytes"] == expected.optimizer_state_bytes
    assert {p["name"] for p in body["estimate"]["parts"]} == {p.name for p in expected.parts}
    assert body["estimate"]["total_formula"] == TOTAL_FORMULA  # so a client without torch can show it
    assert body["plan"] is None


def test_a_warm_estimate_is_answered_on_the_event_loop(
    client: TestClient, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A config nothing else in this process builds (each database's run too), so its first estimate is cold.
    tiny_bert = make_spec()["model"]["config"]
    fresh = {**tiny_bert, "intermediate_size": 1000 + secrets.randbelow(10**6)}
    spec = make_spec(name="fresh", model={"config": fresh})
    threads: list[str] = []
    real = estimates.estimate_response

    def recording(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(estimates, "estimate_response", recording)
    answers = [
        client.post("/v1/estimates/memory", json=body, headers=keys.auth(keys.alice))
        for body in ({"spec": spec}, {"spec": spec}, {"spec": spec, "gpu_memory_gb": 16})
    ]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[0].json()["estimate"] == answers[1].json()["estimate"]
    assert answers[2].json()["estimate"]["total_bytes"] == answers[0].json()["estimate"]["total_bytes"]
    cold, warm, planned = threads
    loop_thread = client.portal.call(lambda: threading.current_thread().name)  # type: ignore[union-attr]
    # Cold (builds the model) and planned (many estimates) run on a worker thread; warm on the loop.
    assert cold != loop_thread and planned != loop_thread and warm == loop_thread


def test_estimate_with_budget_includes_the_plan(client: TestClient, keys: Keys) -> None:
    body = {"spec": BERT_LARGE, "gpu_memory_gb": 1, "devices": 1}
    response = client.post("/v1/estimates/memory", json=body, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["estimate"]["fits"] is False
    expected = plan_memory(JobSpec.model_validate(BERT_LARGE), 1)
    assert answer["plan"]["budget_bytes"] == expected.budget_bytes
    assert len(answer["plan"]["entries"]) == len(expected.entries)


def test_estimate_errors_name_the_field(client: TestClient, keys: Keys) -> None:
    unknown = make_spec(model={"name_or_path": "nobody/no-such-model"})
    response = client.post("/v1/estimates/memory", json={"spec": unknown}, headers=keys.auth(keys.alice))
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "model.name_or_path"
    bad = client.post(
        "/v1/estimates/memory", json={"spec": BERT_LARGE, "gpu_memory_gb": -1}, headers=keys.auth(keys.alice)
    )
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "gpu_memory_gb"
    nested = client.post(
        "/v1/estimates/memory",
        json={"spec": make_spec(optimizer={"name": "sgd"})},
        headers=keys.auth(keys.alice),
    )
    assert nested.status_code == 422 and nested.json()["errors"][0]["field"] == "spec.optimizer.name"
    assert client.post("/v1/estimates/memory", json={"spec": BERT_LARGE}).status_code == 401


def test_catalog_lists_known_models(client: TestClient, keys: Keys) -> None:
    items = client.get("/v1/models/catalog", headers=keys.auth(keys.alice)).json()["items"]
    assert [item["id"] for item in items] == list(catalog_ids())
    one = client.get("/v1/models/catalog/bert-large-uncased", headers=keys.auth(keys.alice))
    assert one.status_code == 200 and one.json()["id"] == "bert-large-uncased"
    assert client.get("/v1/models/catalog/no-such", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get("/v1/models/catalog").status_code == 401


def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["checks"] == {"database": "ok", "broker": "ok"}
    # The warm-up thread imports the estimator and Celery, then says so.
    deadline = time.monotonic() + 120
    while not client.get("/readyz").json()["warmed_up"]:
        assert time.monotonic() < deadline, "the API never finished warming up"
        time.sleep(0.1)
    assert {"trainer_core.memory", "service_core.queue"} <= set(sys.modules)


def test_readyz_is_503_when_the_broker_is_down(settings: Settings) -> None:
    # Nothing listens on port 1: the broker check must fail fast and say so.
    down = settings.model_copy(update={"broker_url_": "redis://127.0.0.1:1/0"})
    from api.main import create_app

    app: FastAPI = create_app(down)
    with TestClient(app) as test_client:
        response = test_client.get("/readyz")
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["checks"]["database"] == "ok"
    assert response.json()["checks"]["broker"].startswith("error")


def test_openapi_has_worked_examples_and_bearer_auth(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert schemas["JobCreate"]["examples"][0]["name"] == "reviews-minilm"
    assert schemas["EstimateRequest"]["examples"][0]["gpu_memory_gb"] == 16
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert "curl" in doc["paths"]["/v1/datasets"]["post"]["description"]
    JobSpec.model_validate(
        {k: v for k, v in schemas["JobCreate"]["examples"][0].items() if k not in ("priority", "queue")}
    )


def test_a_model_folder_under_the_data_root_is_estimated_as_submit_resolves_it(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    from transformers import BertConfig

    config = make_spec()["model"]["config"]
    BertConfig(**config).save_pretrained(settings.data_root / "models" / "tiny-bert")
    spec = make_spec(model={"name_or_path": "models/tiny-bert"})  # relative, as the dev example names it
    response = client.post("/v1/estimates/memory", json={"spec": spec}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    inline = client.post("/v1/estimates/memory", json={"spec": make_spec()}, headers=keys.auth(keys.alice))
    assert response.json()["estimate"]["parameters"] == inline.json()["estimate"]["parameters"]

    outside = make_spec(model={"name_or_path": "../../etc"})
    refused = client.post("/v1/estimates/memory", json={"spec": outside}, headers=keys.auth(keys.alice))
    assert refused.status_code == 422
    assert refused.json()["errors"][0]["field"] == "model.name_or_path"
