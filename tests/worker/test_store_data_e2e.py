"""End to end on an object-store data root (real SeaweedFS): a job whose dataset and model (the packaged
MiniLM) live only in the store is submitted to the API, preflighted there, fetched into the host's cache
by the worker and trained by a run that never sees a store URL or a credential."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from service_core.datastore import CACHE_DIR, DataStore
from tests.conftest import wait_finished
from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from worker.paths import run_paths

from .conftest import make_settings
from .live import live_service

pytestmark = pytest.mark.slow


def test_a_job_on_store_data_and_a_store_model_trains(tmp_path: Path, s3_root: str, minilm_path: Path) -> None:
    home = tmp_path / "var"
    home.mkdir()
    settings = make_settings(home, DATA_ROOT=s3_root)
    store = DataStore.of(settings)
    files = write_sentiment_csv(tmp_path / "sentiment", n_train=32, n_val=8)
    store.put_folder(tmp_path / "sentiment", "sentiment")
    store.put_folder(minilm_path, "models/minilm")
    data_files = {split: f"sentiment/{Path(path).name}" for split, path in files.items()}
    spec = tiny_text_spec(data_files, "models/minilm", training={"max_steps": 3, "num_train_epochs": 1,
                          "per_device_train_batch_size": 8, "logging_steps": 1})  # fmt: skip
    queue = f"store-{uuid.uuid4().hex[:8]}"
    with live_service(settings, queue, tmp_path / "logs") as service, service.client(timeout=120) as client:
        created = client.post("/v1/jobs", json={**spec, "queue": queue})
        assert created.status_code == 201, created.text
        stored = created.json()["spec"]
        assert stored["model"]["name_or_path"] == f"{store.root}/models/minilm"
        assert stored["dataset"]["data_files"]["train"] == f"{store.root}/sentiment/train.csv"
        job = wait_finished(client, created.json()["id"], timeout=240)
        assert job["status"] == "succeeded", (job["error"], (tmp_path / "logs" / "worker.log").read_text()[-3000:])
        assert job["progress"]["step"] == 3
    # The run read this host's cached copies: its spec names no store URL.
    run_spec = json.loads(run_paths(job["id"], settings).spec_file.read_text())
    assert "s3://" not in json.dumps(run_spec)
    cached = Path(run_spec["model"]["name_or_path"])
    assert cached.parent == home.resolve() / CACHE_DIR and (cached / "model.safetensors").is_file()
    assert Path(run_spec["dataset"]["data_files"]["train"]).read_bytes() == Path(files["train"]).read_bytes()
    assert not (home / "data").exists()  # no local data root was needed
