"""Data in through the API host, training on a worker host: nothing crosses between hosts but the
database, the broker and the object store. (Models out through the API host: test_init_from.py.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.trainer_core.datagen import write_sentiment_csv
from tests.worker.test_service_e2e import poll_metrics

from .stack import TERMINAL, Fleet, dataset_spec, upload_csv, wait_for

pytestmark = pytest.mark.slow


def test_an_upload_through_the_api_host_trains_on_a_worker_host(fleet_stack: Fleet, queue: str, tmp_path: Path) -> None:
    fleet, worker = fleet_stack, fleet_stack.worker_hosts[0]
    csv = Path(write_sentiment_csv(tmp_path, n_train=40, n_val=8, seed=3)["train"])
    with fleet.client() as client:
        uploaded = upload_csv(client, csv)
        assert uploaded["content_hash"] == hashlib.sha256(csv.read_bytes()).hexdigest()
        fleet.start_workers([worker], queue)
        created = client.post("/v1/jobs", json={**dataset_spec(uploaded["id"]), "queue": queue})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        wait_for("the job to end", lambda: fleet.job(job_id).status in TERMINAL, timeout=240)
        job = client.get(f"/v1/jobs/{job_id}").json()
        steps = [point["step"] for point in poll_metrics(client, job_id, 30) if point["name"] == "loss"]
    assert job["status"] == "succeeded", job["error"]
    assert fleet.job(job_id).worker == worker.name
    # 40 uploaded rows, batches of 8, one epoch: the run read exactly the upload.
    assert job["progress"]["step"] == job["progress"]["total"] == 5
    assert steps == [1, 2, 3, 4, 5]
