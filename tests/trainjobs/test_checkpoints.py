"""A job's checkpoints over HTTP, the CLI and the event stream, on the live service (local artifacts
root, SQLite): one tiny job that saves at steps 2, 4 and 6 and evaluates at 3 and 6, shared by the tests."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import wait_finished
from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService

pytestmark = pytest.mark.slow

SAVED = [2, 4, 6]


@pytest.fixture(scope="module")
def http(service: LiveService) -> httpx.Client:
    return httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.key}"}, timeout=60)


@pytest.fixture(scope="module")
def job_id(service: LiveService, sentiment_files: dict[str, str], http: httpx.Client) -> str:
    """96 examples in batches of 16: 6 steps; a loss point every step."""
    training = {"max_steps": 6, "num_train_epochs": 1, "save_steps": 2, "logging_steps": 1,
                "eval_strategy": "steps", "eval_steps": 3}  # fmt: skip
    created = http.post("/v1/jobs", json=job_spec(sentiment_files, "ckpts", training=training))
    assert created.status_code == 201, created.text
    job = wait_finished(http, created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    return str(job["id"])


def points(http: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    page = http.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 10000}).json()
    assert not page["has_more"]
    return list(page["items"])


def loss_at(metric_points: list[dict[str, Any]], step: int) -> dict[str, Any]:
    (point,) = [p for p in metric_points if p["name"] == "loss" and p["step"] == step]
    return point


def test_the_list_has_every_checkpoint_with_its_metrics(service: LiveService, http: httpx.Client, job_id: str) -> None:
    listing = http.get(f"/v1/jobs/{job_id}/checkpoints")
    assert listing.status_code == 200, listing.text
    body = listing.json()
    items = body["items"]
    assert [item["step"] for item in items] == SAVED
    assert body["best_metric"] == "eval_loss" and body["greater_is_better"] is False
    metric_points = points(http, job_id)
    evals = {p["step"]: p["value"] for p in metric_points if p["name"] == "eval_loss"}
    assert sorted(evals) == [3, 6]
    folder = Path(service.home) / "artifacts" / job_id
    for item in items:
        point = loss_at(metric_points, item["step"])
        assert item["loss"] == point["value"] and item["epoch"] == point["epoch"]
        on_disk = sum(f.stat().st_size for f in (folder / f"checkpoint-{item['step']}").rglob("*") if f.is_file())
        assert item["size"] == on_disk > 0
        assert item["kept"] is True  # no save_total_limit: every checkpoint stays
        assert item["download_url"] == f"/v1/jobs/{job_id}/checkpoints/{item['step']}.zip"
    # The newest evaluation at or before each step: none before 3, then step 3's, then step 6's.
    assert [item["eval_step"] for item in items] == [None, 3, 6]
    assert items[0]["eval_metrics"] == {}
    assert items[1]["eval_metrics"]["eval_loss"] == evals[3] and items[2]["eval_metrics"]["eval_loss"] == evals[6]
    # Only a checkpoint evaluated at its own step is a candidate for best (the run's rule): step 6.
    assert [item["step"] for item in items if item["is_best"]] == [6]


def test_a_checkpoint_downloads_as_a_loadable_model_without_the_optimizer(
    service: LiveService, http: httpx.Client, job_id: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    answer = http.get(f"/v1/jobs/{job_id}/checkpoints/4.zip")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(answer.content)) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path)
    assert "checkpoint-4/model.safetensors" in names and "checkpoint-4/trainjobs_checkpoint.json" in names
    assert not any(name.startswith("checkpoint-4/optimizer") for name in names), names
    folder = tmp_path / "checkpoint-4"
    stored = Path(service.home) / "artifacts" / job_id / "checkpoint-4"
    assert (folder / "model.safetensors").read_bytes() == (stored / "model.safetensors").read_bytes()
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    logits = model(**tokenizer(["a fine film"], return_tensors="pt")).logits
    assert logits.shape == (1, 2)

    full = http.get(f"/v1/jobs/{job_id}/checkpoints/4.zip", params={"with_optimizer": "true"})
    with zipfile.ZipFile(io.BytesIO(full.content)) as archive:
        assert "checkpoint-4/optimizer.pt" in archive.namelist()


def test_an_unknown_step_or_another_owners_job_is_a_404(service: LiveService, http: httpx.Client, job_id: str) -> None:
    missing = http.get(f"/v1/jobs/{job_id}/checkpoints/3.zip")
    assert missing.status_code == 404
    assert missing.headers["content-type"].startswith("application/problem+json")
    assert [e["field"] for e in missing.json()["errors"]] == ["step"]
    not_a_step = http.get(f"/v1/jobs/{job_id}/checkpoints/last.zip")
    assert not_a_step.status_code == 422 and "step" in not_a_step.text
    made = service.cli("keys", "create", "--owner", "checkpoint-stranger")
    assert made.returncode == 0, made.stderr
    stranger = {"Authorization": f"Bearer {made.stdout.strip()}"}
    for url in (f"/v1/jobs/{job_id}/checkpoints", f"/v1/jobs/{job_id}/checkpoints/4.zip"):
        answer = http.get(url, headers=stranger)
        assert answer.status_code == 404, (url, answer.text)
        assert answer.headers["content-type"].startswith("application/problem+json")


def test_the_stream_has_one_checkpoint_event_per_checkpoint(service: LiveService, http: httpx.Client,
                                                            job_id: str) -> None:  # fmt: skip
    events = [e for e in service.client().events(job_id) if e.event == "checkpoint"]
    assert [e.data["step"] for e in events] == SAVED
    metric_points = points(http, job_id)
    for event in events:
        point = loss_at(metric_points, event.data["step"])
        assert event.data["loss"] == point["value"] and event.data["epoch"] == point["epoch"]
        assert event.seq is not None and event.seq > point["seq"]  # after its step's loss, in stream order


def test_the_cli_prints_the_table_and_downloads_the_best(service: LiveService, http: httpx.Client, job_id: str,
                                                         tmp_path: Path) -> None:  # fmt: skip
    from transformers import AutoModelForSequenceClassification

    table = service.cli("jobs", "checkpoints", job_id)
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["STEP", "EPOCH", "LOSS", "EVAL_LOSS"]
    assert [int(row.split()[0]) for row in rows] == SAVED
    items = http.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
    for row, item in zip(rows, items, strict=True):
        assert float(row.split()[2]) == pytest.approx(item["loss"], abs=1e-4)
        assert ("*" in row.split()) == item["is_best"]
    (best,) = [item["step"] for item in items if item["is_best"]]

    got = service.cli("jobs", "download", job_id, "--checkpoint", "best", "--to", str(tmp_path / "dl"))
    assert got.returncode == 0, got.stderr
    folder = Path(got.stdout.strip())
    assert folder == tmp_path / "dl" / f"checkpoint-{best}"
    assert not (folder / "optimizer.pt").exists()
    AutoModelForSequenceClassification.from_pretrained(folder)
    missing = service.cli("jobs", "download", job_id, "--checkpoint", "5", "--to", str(tmp_path / "no"))
    assert missing.returncode != 0 and "step" in missing.stderr and "Traceback" not in missing.stderr


def test_a_job_that_stops_improving_stops_early_and_succeeds_saying_so(
    sentiment_files: dict[str, str], http: httpx.Client
) -> None:
    """Issue 26's early stopping on the service: an evaluation every step, none counting as better
    than the first (min_delta far above any change), patience 2: the job ends at step 3 of 12."""
    training = {"max_steps": 12, "num_train_epochs": 1, "logging_steps": 1, "eval_strategy": "steps",
                "eval_steps": 1, "save_steps": 100}  # fmt: skip
    spec = job_spec(sentiment_files, "stops-early", training=training,
                    early_stopping={"patience": 2, "min_delta": 1e6})  # fmt: skip
    created = http.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = wait_finished(http, created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["final_metrics"]["stopped_early"] is True and job["final_metrics"]["stopped_at_step"] == 3
    assert job["progress"]["step"] == 3
    artifacts = {a["path"] for a in http.get(f"/v1/jobs/{job['id']}/artifacts").json()["items"]}
    assert "model.safetensors" in artifacts  # the final model, as at a normal end


def test_retention_keeps_the_best_checkpoint_and_the_newest_and_the_list_says_so(
    sentiment_files: dict[str, str], http: httpx.Client
) -> None:
    """keep_best_checkpoint with save_total_limit 1: the best by eval_loss (on this data and seed the
    eval loss of the tiny model rises, so an early one) and the newest stay; the listing marks the best
    and both as kept."""
    training = {"max_steps": 6, "num_train_epochs": 1, "logging_steps": 2, "eval_strategy": "steps",
                "eval_steps": 2, "save_steps": 2, "save_total_limit": 1, "keep_best_checkpoint": True}  # fmt: skip
    created = http.post("/v1/jobs", json=job_spec(sentiment_files, "keeps-best", training=training))
    assert created.status_code == 201, created.text
    job = wait_finished(http, created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    evals = [p for p in points(http, job["id"]) if p["name"] == "eval_loss"]
    best = min(evals, key=lambda p: (p["value"], p["step"]))["step"]
    listing = http.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
    assert best < 6, "the test needs an older best"
    assert [item["step"] for item in listing] == [best, 6]
    assert [item["step"] for item in listing if item["is_best"]] == [best]
    assert all(item["kept"] for item in listing)
