"""``init_from`` across hosts (PostgreSQL, Redis, the object store): a job trained on one worker host
continues on the other from the checkpoint the store holds, with no disk in common; the API host serves
the checkpoint and the new model, which loads and predicts."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.worker.test_service_e2e import download_artifacts, predict_with

from .stack import TERMINAL, Fleet, dataset_spec, new_queue, wait_for

pytestmark = pytest.mark.slow


def test_a_job_continues_on_another_host_from_the_stored_checkpoint(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str, tmp_path: Path
) -> None:
    fleet = fleet_stack
    first, second = fleet.worker_hosts
    fleet.start_workers([first], queue)
    with fleet.client() as client:
        created = client.post("/v1/jobs", json={**dataset_spec(sentiment_dataset, max_steps=8, save_steps=4),
                                                "queue": queue})  # fmt: skip
        assert created.status_code == 201, created.text
        parent = created.json()["id"]
        wait_for("the parent to end", lambda: fleet.job(parent).status in TERMINAL, timeout=240)
        assert fleet.job(parent).status == "succeeded", fleet.job(parent).error_message
        # Step 8's upload may supersede step 4's while it waits (the uploader sends the newest): 8 is there.
        stored = fleet.stored_checkpoints(parent)
        assert stored[-1] == 8 and set(stored) <= {4, 8}
        listed = client.get(f"/v1/jobs/{parent}/checkpoints").json()["items"]  # the API host reads the store
        assert [(item["step"], item["kept"]) for item in listed] == [(step, True) for step in stored]
        other = new_queue()
        try:
            fleet.start_workers([second], other)
            still = dataset_spec(sentiment_dataset, max_steps=1, learning_rate=1e-9)
            init_from = {"job": parent, "checkpoint": "last"}
            created = client.post("/v1/jobs", json={**still, "queue": other, "init_from": init_from})
            assert created.status_code == 201, created.text
            child = created.json()["id"]
            assert created.json()["started_from"]["checkpoint"] == 8  # `last`, pinned at submit
            wait_for("the child to end", lambda: fleet.job(child).status in TERMINAL, timeout=240)
        finally:
            fleet.stop_workers(other)
        assert fleet.job(child).status == "succeeded", fleet.job(child).error_message
        assert (fleet.job(parent).worker, fleet.job(child).worker) == (first.name, second.name)
        assert client.get(f"/v1/jobs/{parent}").json()["continued_by"] == [child]
        archive = client.get(f"/v1/jobs/{parent}/checkpoints/8.zip")
        assert archive.status_code == 200, archive.text
        with zipfile.ZipFile(io.BytesIO(archive.content)) as opened:
            opened.extractall(tmp_path)
        # The child's model, trained on the second host, downloads file by file through the API host.
        model_dir = download_artifacts(client, child, tmp_path / "child")
        assert {"model.safetensors", "config.json", "tokenizer.json"} <= {path.name for path in model_dir.iterdir()}
    # The API host served what the worker hosts stored: neither its disk nor this one's was shared.
    assert not list(fleet.api.disk.rglob("model.safetensors"))
    predict_with(model_dir)
    started = load_file(str(tmp_path / "checkpoint-8" / "model.safetensors"))
    ended = load_file(str(model_dir / "model.safetensors"))
    # One step at a learning rate of 1e-9 from step 8's weights (its own random init would be far off).
    assert started.keys() == ended.keys()
    assert all(torch.allclose(started[name], ended[name], atol=1e-6) for name in started)
