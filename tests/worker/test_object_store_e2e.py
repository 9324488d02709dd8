"""End to end on object storage (real SeaweedFS), one live service for both tests: its data root and its
artifacts root are prefixes of the session's store.

- A job whose dataset and model (the packaged MiniLM) live only in the store is submitted to the API,
  preflighted there, fetched into the host's cache by the worker and trained by a run that never sees a
  store URL or a credential.
- Checkpoints in the store as users see them: the API lists the store's complete checkpoints and
  downloads one as a loadable model, and the job's stream has one ``checkpoint`` event per checkpoint
  committed to the store.
"""

from __future__ import annotations

import io
import json
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service_core.checkpoints import CheckpointStore
from service_core.datastore import CACHE_DIR, DataStore
from tests.conftest import wait_finished
from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from trainjobs.client import Client
from trainjobs.seaweedfs import SeaweedFS
from worker.paths import run_paths

from .conftest import make_settings, quick_spec
from .live import LiveService, live_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(seaweedfs: SeaweedFS, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    root = tmp_path_factory.mktemp("object-store")
    home = root / "var"
    home.mkdir()
    prefix = seaweedfs.url(f"e2e/{uuid.uuid4().hex[:12]}")
    settings = make_settings(home, DATA_ROOT=f"{prefix}/data", ARTIFACTS_ROOT=f"{prefix}/artifacts")
    queue = f"store-{uuid.uuid4().hex[:8]}"
    with live_service(settings, queue, root / "logs") as live:
        yield live


@pytest.fixture(scope="module")
def store_sentiment(service: LiveService, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """The sentiment CSVs in the service's data store (names relative to it), and the local folder they came from."""
    local = tmp_path_factory.mktemp("sentiment")
    files = write_sentiment_csv(local, n_train=64, n_val=16)
    DataStore.of(service.settings).put_folder(local, "sentiment")
    return {split: f"sentiment/{Path(path).name}" for split, path in files.items()}, local


def test_a_job_on_store_data_and_a_store_model_trains(
    service: LiveService, store_sentiment: tuple[dict[str, str], Path], minilm_path: Path
) -> None:
    settings = service.settings
    store = DataStore.of(settings)
    store.put_folder(minilm_path, "models/minilm")
    data_files, local = store_sentiment
    spec = tiny_text_spec(data_files, "models/minilm", training={"max_steps": 3, "num_train_epochs": 1,
                          "per_device_train_batch_size": 8, "logging_steps": 1})  # fmt: skip
    with service.client(timeout=120) as client:
        created = client.post("/v1/jobs", json={**spec, "queue": service.queue})
        assert created.status_code == 201, created.text
        stored = created.json()["spec"]
        assert stored["model"]["name_or_path"] == f"{store.root}/models/minilm"
        assert stored["dataset"]["data_files"]["train"] == f"{store.root}/sentiment/train.csv"
        job = wait_finished(client, created.json()["id"], timeout=240)
        assert job["status"] == "succeeded", (job["error"], (service.log_dir / "worker.log").read_text()[-3000:])
        assert job["progress"]["step"] == 3
    # The run read this host's cached copies: its spec names no store URL.
    run_spec = json.loads(run_paths(job["id"], settings).spec_file.read_text())
    assert "s3://" not in json.dumps(run_spec)
    cached = Path(run_spec["model"]["name_or_path"])
    assert cached.parent == settings.home.resolve() / CACHE_DIR and (cached / "model.safetensors").is_file()
    assert Path(run_spec["dataset"]["data_files"]["train"]).read_bytes() == (local / "train.csv").read_bytes()


def test_store_checkpoints_are_listed_downloaded_and_announced(
    service: LiveService, store_sentiment: tuple[dict[str, str], Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForSequenceClassification

    artifacts = str(service.settings.artifacts_root)
    spec = quick_spec(store_sentiment[0], save_steps=2, save_total_limit=2)  # 8 steps, evaluated at the end
    with service.client(timeout=120) as http:
        created = http.post("/v1/jobs", json={**spec, "queue": service.queue})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        job = wait_finished(http, job_id, timeout=240)
        assert job["status"] == "succeeded", (job["error"], (service.log_dir / "worker.log").read_text()[-3000:])

        stored = CheckpointStore(artifacts, job_id).steps()
        listing = http.get(f"/v1/jobs/{job_id}/checkpoints").json()
        items = listing["items"]
        assert [item["step"] for item in items] == stored and stored[-1] == 8 and len(stored) <= 2
        losses = {p["step"]: p for p in http.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["items"]}
        for item in items:
            manifest = CheckpointStore(artifacts, job_id).manifest(item["step"])
            assert item["size"] == sum(f["size"] for f in manifest["files"]) > 0
            assert item["loss"] == losses[item["step"]]["value"]
        assert [item["is_best"] for item in items][-1] is True  # the only evaluation is the last step's

        answer = http.get(f"/v1/jobs/{job_id}/checkpoints/8.zip")
        assert answer.status_code == 200, answer.text
        with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
            names = archive.namelist()
            archive.extractall(tmp_path / "dl")
        assert "checkpoint-8/manifest.json" not in names and "checkpoint-8/optimizer.pt" not in names
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "dl" / "checkpoint-8")
        assert http.get(f"/v1/jobs/{job_id}/checkpoints/1.zip").status_code == 404

        # One event per checkpoint committed to the store, in order; the store keeps the newest two.
        events = [e for e in Client(service.url, service.api_key).events(job_id) if e.event == "checkpoint"]
        steps = [e.data["step"] for e in events]
        assert steps == sorted(set(steps)) and steps[-2:] == stored
        for event in events:
            assert event.data["loss"] == losses[event.data["step"]]["value"]
