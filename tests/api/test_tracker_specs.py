"""Trackers at the API: a spec's MLflow server must be public (unless the testing aid lifts the rule),
and the run's tracker links, stored by the worker's ingest path, come back on ``GET /v1/jobs/{id}``."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.main import create_app
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import JobStatus
from trainer_core.events import make_event
from worker.ingest import EventIngestor

from .conftest import Keys, add_job, make_spec

FIELD = "integrations.mlflow.tracking_uri"


def mlflow_spec(uri: str) -> dict[str, Any]:
    spec = make_spec()
    spec["training"] = {**spec["training"], "report_to": ["mlflow"]}
    return {**spec, "integrations": {"mlflow": {"tracking_uri": uri}}}


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "http://mlflow.internal", "file:///srv/mlruns"])
def test_a_private_or_local_tracking_uri_is_refused_naming_the_field(client: TestClient, keys: Keys, uri: str) -> None:
    response = client.post("/v1/jobs", json=mlflow_spec(uri), headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == [FIELD]


def test_allow_private_targets_lets_a_local_tracking_server_through(settings: Settings, keys: Keys) -> None:
    private = settings.model_copy(update={"allow_private_targets": True})
    with TestClient(create_app(private)) as client:
        response = client.post("/v1/jobs", json=mlflow_spec("http://127.0.0.1:5000"), headers=keys.auth(keys.alice))
        assert response.status_code == 201, response.text
        refused = client.post("/v1/jobs", json=mlflow_spec("sqlite:///x.db"), headers=keys.auth(keys.alice))
        assert refused.status_code == 422 and refused.json()["errors"][0]["field"] == FIELD  # http(s) still


def test_run_tracker_links_are_stored_and_returned(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    job = add_job(session, "alice", JobStatus.running)
    assert client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()["tracker_links"] is None
    links = {
        "wandb": {"url": None, "run_id": "abc123", "dir": "/runs/wandb/offline-run-abc123/files"},
        "mlflow": {"url": "https://mlflow.example.com/#/experiments/3/runs/r1", "run_id": "r1", "experiment_id": "3"},
    }
    # What the worker does with the run's `trackers` event (worker/ingest.py).
    ingestor = EventIngestor(job.id, lambda: session_scope(settings.database_url))
    ingestor.add(make_event("trackers", links=links))
    ingestor.flush(final=True)
    got = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()["tracker_links"]
    assert got == {
        "wandb": {**links["wandb"], "experiment_id": None},
        "mlflow": {**links["mlflow"], "dir": None},
    }
    assert client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.bob)).status_code == 404
