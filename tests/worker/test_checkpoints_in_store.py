"""Checkpoints on an object-store artifacts root (real SeaweedFS) as users see them: the API lists the
store's complete checkpoints and downloads one as a loadable model, and the job's stream has one
``checkpoint`` event per checkpoint committed to the store."""

from __future__ import annotations

import io
import uuid
import zipfile
from pathlib import Path

import pytest

from service_core.checkpoints import CheckpointStore
from tests.conftest import wait_finished
from trainjobs.client import Client

from .conftest import make_settings, quick_spec
from .live import live_service

pytestmark = pytest.mark.slow


def test_store_checkpoints_are_listed_downloaded_and_announced(
    tmp_path: Path, s3_root: str, shared_data_root: Path, sentiment_files: dict[str, str]
) -> None:
    from transformers import AutoModelForSequenceClassification

    home = tmp_path / "var"
    home.mkdir()
    settings = make_settings(home, ARTIFACTS_ROOT=s3_root, DATA_ROOT=str(shared_data_root))
    spec = quick_spec(sentiment_files, save_steps=2, save_total_limit=2)  # 8 steps, evaluated at the end
    queue = f"ckpt-{uuid.uuid4().hex[:8]}"
    with live_service(settings, queue, tmp_path / "logs") as service, service.client(timeout=120) as http:
        created = http.post("/v1/jobs", json={**spec, "queue": queue})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        job = wait_finished(http, job_id, timeout=240)
        assert job["status"] == "succeeded", (job["error"], (tmp_path / "logs" / "worker.log").read_text()[-3000:])

        stored = CheckpointStore(s3_root, job_id).steps()
        listing = http.get(f"/v1/jobs/{job_id}/checkpoints").json()
        items = listing["items"]
        assert [item["step"] for item in items] == stored and stored[-1] == 8 and len(stored) <= 2
        losses = {p["step"]: p for p in http.get(f"/v1/jobs/{job_id}/metrics", params={"name": "loss"}).json()["items"]}
        for item in items:
            manifest = CheckpointStore(s3_root, job_id).manifest(item["step"])
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
