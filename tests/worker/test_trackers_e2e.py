"""W&B and MLflow through the whole service: API (uvicorn) + worker + a real tiny run.

The worker's environment holds W&B's settings (offline, a directory) and a key; the run gets them
because its spec reports to W&B (worker/run_env.py). The spec's MLflow server is on this machine,
allowed by TRAINJOBS_ALLOW_PRIVATE_TARGETS. The run's links land in ``jobs.tracker_links`` and come
back on ``GET /v1/jobs/{id}``; both trackers hold the job's own metric points.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.mlflow_server import MlflowServer
from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainer_core.test_trackers import wandb_history, wandb_records

from .conftest import make_settings, quick_spec
from .live import live_service

pytestmark = pytest.mark.slow


def test_a_job_reports_to_wandb_and_mlflow_and_shows_their_links(
    tmp_path: Path, mlflow_tracking: MlflowServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    from tests.conftest import wait_finished

    wandb_dir = tmp_path / "wandb"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the worker's environment, passed on to the run
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    (tmp_path / "var").mkdir()
    settings = make_settings(tmp_path / "var", TRAINJOBS_ALLOW_PRIVATE_TARGETS="true")
    queue = f"trackers-{uuid.uuid4().hex[:8]}"
    experiment = f"e2e-{queue}"
    with live_service(settings, queue, tmp_path / "logs") as service, service.client(timeout=30) as client:
        files = write_sentiment_csv(settings.data_root / "sentiment", n_train=32, n_val=8)
        spec = quick_spec(files, report_to=["wandb", "mlflow"], eval_strategy="steps", eval_steps=2)
        spec["integrations"] = {"mlflow": {"tracking_uri": mlflow_tracking.url, "experiment": experiment}}
        created = client.post("/v1/jobs", json={**spec, "queue": queue})
        assert created.status_code == 201, created.text
        job = wait_finished(client, created.json()["id"])
        assert job["status"] == "succeeded", job["error"]
        points = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 1000}).json()["items"]

    expected: dict[str, list[tuple[int, float]]] = {}
    for point in points:
        expected.setdefault(point["name"], []).append((point["step"], point["value"]))
    links = job["tracker_links"]
    assert set(links) == {"wandb", "mlflow"}

    assert links["wandb"]["url"] is None and links["wandb"]["dir"].startswith(str(wandb_dir))
    (run_file,) = wandb_dir.rglob(f"run-{links['wandb']['run_id']}.wandb")
    assert wandb_history(wandb_records(run_file)) == expected

    mlflow = MlflowClient(tracking_uri=mlflow_tracking.url)
    run = mlflow.get_run(links["mlflow"]["run_id"])
    page = f"{mlflow_tracking.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert links["mlflow"]["url"] == page
    assert run.info.status == "FINISHED" and run.data.params["name"] == spec["name"]
    for name, want in expected.items():
        got = sorted((m.step, m.value) for m in mlflow.get_metric_history(run.info.run_id, name))
        assert got == want, name
