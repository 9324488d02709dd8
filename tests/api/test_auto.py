"""``auto`` at submit: the dry run and the job show each chosen value and why, the stored spec holds the
numbers, and the micro-batch's budget comes from the queue, else from what the queue's workers report."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from service_core.db.base import utcnow
from service_core.db.models import Job, WorkerHeartbeat
from trainer_core.auto import MAX_CPU_MICRO_BATCH, MIN_TARGET_EXAMPLES, auto_learning_rate, with_values
from trainer_core.memory import estimate_memory
from trainer_core.spec import parse_spec

from .conftest import Keys, make_spec

AUTO = {"per_device_train_batch_size": "auto", "num_train_epochs": "auto", "learning_rate": "auto"}
TRAIN_ROWS = 32  # tests/api/conftest.py's reviews/train.csv


def auto_spec(**training: Any) -> dict[str, Any]:
    return make_spec(training={**AUTO, **training})


def gib(batch: int) -> float:
    spec = parse_spec({**make_spec(), "dataset": {"path": "csv", "data_files": {"train": "/x.csv"}}})
    return estimate_memory(with_values(spec, {"per_device_train_batch_size": batch})).total_bytes / 2**30


def by_field(choices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {choice["field"]: choice for choice in choices}


def report_worker(session: Session, queue: str, gb: float, kind: str) -> None:
    session.add(WorkerHeartbeat(name=f"w-{queue}", queues=[queue], slots=1, busy=0, heartbeat_at=utcnow(),
                                device_memory_gb=gb, device_kind=kind))  # fmt: skip
    session.commit()


def test_the_dry_run_and_the_job_show_what_auto_chose(
    app: FastAPI, client: TestClient, keys: Keys, session: Session
) -> None:
    app.state.enqueue = lambda *args: None
    report_worker(session, "gpu-w", (gib(8) + gib(16)) / 2, "gpu")  # the queue's worker fits 8, not 16
    body = {**auto_spec(), "queue": "gpu-w"}
    dry = client.post("/v1/jobs", params={"dry_run": "true"}, json=body, headers=keys.auth(keys.alice))
    assert dry.status_code == 200, dry.text
    chosen = by_field(dry.json()["auto"])
    batch = chosen["training.per_device_train_batch_size"]
    assert batch["value"] == 8 and "queue gpu-w's smallest worker" in batch["why"]
    epochs = math.ceil(MIN_TARGET_EXAMPLES / TRAIN_ROWS)  # 32 rows: enough epochs to see 100 examples
    assert chosen["training.num_train_epochs"]["value"] == epochs
    training = dry.json()["spec"]["training"]
    assert (training["per_device_train_batch_size"], training["num_train_epochs"]) == (8, epochs)
    assert "auto" not in training and training["learning_rate"] == chosen["training.learning_rate"]["value"]

    created = client.post("/v1/jobs", json=body, headers=keys.auth(keys.alice))
    assert created.status_code == 201, created.text
    job = client.get(f"/v1/jobs/{created.json()['id']}", headers=keys.auth(keys.alice)).json()
    assert job["auto"] == dry.json()["auto"]
    stored = session.get(Job, job["id"])
    assert stored is not None and stored.spec["training"] == training  # the run trains exactly these
    rate = auto_learning_rate(parse_spec({**stored.spec, "dataset": {"path": "csv", "data_files": {"train": "/x"}}}))
    assert training["learning_rate"] == rate[0]


def test_a_cpu_worker_caps_the_batch(app: FastAPI, client: TestClient, keys: Keys, session: Session) -> None:
    report_worker(session, "cpu-w", 12.0, "cpu")
    dry = client.post("/v1/jobs", params={"dry_run": "true"}, json={**auto_spec(), "queue": "cpu-w"},
                      headers=keys.auth(keys.alice))  # fmt: skip
    batch = by_field(dry.json()["auto"])["training.per_device_train_batch_size"]
    assert batch["value"] == MAX_CPU_MICRO_BATCH and "CPU" in batch["why"]


def test_a_queue_budget_nothing_fits_is_a_422_naming_the_field(client: TestClient, keys: Keys) -> None:
    # tests/api/conftest.py: queue gpu-1g has a 1.0 GB budget, less than the tiny model's 1 GiB overhead
    # and one example.
    answer = client.post("/v1/jobs", json={**auto_spec(), "queue": "gpu-1g"}, headers=keys.auth(keys.alice))
    assert answer.status_code == 422
    assert answer.headers["content-type"] == "application/problem+json"
    (error,) = answer.json()["errors"]
    assert error["field"] == "training.per_device_train_batch_size" and "queue gpu-1g's budget" in error["message"]


def test_no_auto_no_choices(client: TestClient, keys: Keys) -> None:
    dry = client.post("/v1/jobs", params={"dry_run": "true"}, json=make_spec(), headers=keys.auth(keys.alice))
    assert dry.status_code == 200 and dry.json()["auto"] is None


def test_the_estimate_endpoint_chooses_as_submit_would(client: TestClient, keys: Keys) -> None:
    budget = (gib(8) + gib(16)) / 2
    body = {"spec": make_spec(training=AUTO), "gpu_memory_gb": budget}
    answer = client.post("/v1/estimates/memory", json=body, headers=keys.auth(keys.alice))
    assert answer.status_code == 200, answer.text
    chosen = by_field(answer.json()["auto"])
    assert chosen["training.per_device_train_batch_size"]["value"] == 8 and answer.json()["estimate"]["fits"]
    assert "training.num_train_epochs" not in chosen  # no rows given: a memory estimate leaves them
    with_rows = client.post("/v1/estimates/memory", json={**body, "train_rows": 10}, headers=keys.auth(keys.alice))
    assert by_field(with_rows.json()["auto"])["training.num_train_epochs"]["value"] == 10
