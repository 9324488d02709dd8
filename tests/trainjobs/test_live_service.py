"""Client and CLI against a live service (API + worker processes, real tiny trainings).

Each CLI call is a subprocess, as a user runs it: exit codes and what lands on stdout/stderr are
what the tests check.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service_core.status import ErrorReason, exit_code
from tests.trainer_core.datagen import write_image_folder, write_sentiment_csv
from tests.trainjobs.conftest import job_spec, write_json
from tests.trainjobs.live import LiveService
from trainjobs.client import ApiError

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def succeeded(values: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return values[("trainjobs_jobs_finished_total", (("status", "succeeded"),))]


def test_submit_follow_runs_to_success(service: LiveService, sentiment_files: dict[str, str], tmp_path: Path) -> None:
    before = scrape(service.url)
    spec_path = write_json(tmp_path / "job.json", job_spec(sentiment_files, "follow-me"))

    result = service.cli("submit", str(spec_path), "--follow")

    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[0]
    assert "status succeeded" in result.stderr
    assert "loss=" in result.stderr and "eval_accuracy=" in result.stderr  # the bar's postfix
    assert "Traceback" not in result.stderr
    shown = json.loads(service.cli("jobs", "show", job_id).stdout)
    assert shown["status"] == "succeeded" and shown["progress"]["step"] == shown["progress"]["total"]
    assert job_id in service.cli("jobs", "list", "--status", "succeeded").stdout
    assert job_id in service.cli("jobs", "list", "--owner", "admin").stdout  # the bootstrap key's owner
    assert job_id not in service.cli("jobs", "list", "--owner", "nobody").stdout
    # Charged: its one attempt, at the queue's price (TRAINJOBS_QUEUE_PRICES); `usage` over the instant it
    # finished holds this job alone.
    charged = shown["usage"]
    attempt = datetime.fromisoformat(shown["finished_at"]) - datetime.fromisoformat(shown["started_at"])
    assert charged["run_seconds"] == pytest.approx(attempt.total_seconds(), abs=1e-3) and charged["run_seconds"] > 0
    assert charged["cost"] == pytest.approx(charged["device_hours"] * 1.5)
    finished = datetime.fromisoformat(shown["finished_at"])
    instant = ["--from", finished.isoformat(), "--to", (finished + timedelta(microseconds=1)).isoformat()]
    report = json.loads(service.cli("usage", "--group-by", "queue", "--json", *instant).stdout)
    assert [g["key"] for g in report["groups"]] == ["default"] and report["total"]["jobs"] == {"succeeded": 1}
    assert report["total"]["device_hours"] == pytest.approx(charged["device_hours"])
    table = service.cli("usage", "--group-by", "owner", *instant).stdout.splitlines()
    assert table[1].split()[:2] == ["admin", f"{charged['device_hours']:.4f}"]
    # The service's time estimate from the CLI: the same count as the one stored with the job.
    estimated = service.cli("estimate", str(spec_path), "--remote", "--json", "--train-rows",
                            str(shown["estimate"]["time"]["train_samples"] // 2), "--eval-rows", "32")  # fmt: skip
    assert estimated.returncode == 0, estimated.stderr
    time = json.loads(estimated.stdout)["time"]
    assert time["flops_per_train_sample"] == shown["estimate"]["time"]["flops_per_train_sample"]
    assert time["train_samples"] == shown["estimate"]["time"]["train_samples"]  # 2 epochs of those rows
    assert "time: " in service.cli("estimate", str(spec_path), "--remote", "--train-rows", "96").stdout
    logs = service.cli("jobs", "logs", job_id).stdout.splitlines()
    assert "status running" in logs[0] and "status succeeded" in logs[-1]
    assert any(" metric step=" in line and "loss=" in line for line in logs)

    client = service.client()
    losses = client.metrics(job_id, name="loss", page_size=2)  # several pages
    assert len(losses) >= 3 and all(p["name"] == "loss" for p in losses)
    assert [p["seq"] for p in losses] == sorted({p["seq"] for p in losses})
    paths = {a["path"] for a in client.artifacts(job_id)}
    assert "worker.log" in paths and "config.json" in paths
    config = client.download(job_id, "config.json", tmp_path / "dl")
    assert json.loads(config.read_text())["model_type"] == "bert"

    # The worker's logs: JSON lines (not a terminal), each line about this job tagged with its id.
    logged = [json.loads(line) for line in (service.logs / "worker.log").read_text().splitlines()
              if line.startswith("{")]  # fmt: skip
    about_job = [entry for entry in logged if job_id in entry["message"]]
    assert about_job and all(entry.get("job_id") == job_id for entry in about_job)

    after = scrape(service.url)
    assert succeeded(after) == succeeded(before) + 1
    submits = ("trainjobs_http_request_duration_seconds_count",
               (("method", "POST"), ("route", "/v1/jobs"), ("status", "201")))  # fmt: skip
    assert after[submits] == before.get(submits, 0) + 1
    durations = ("trainjobs_job_duration_seconds_count", ())
    assert after[durations] == before[durations] + 1


def test_follow_survives_an_api_restart(service: LiveService, sentiment_files: dict[str, str]) -> None:
    spec = job_spec(sentiment_files, "restart-me", training={"num_train_epochs": 4, "logging_steps": 1})
    client = service.client()
    job_id = client.submit(spec)["id"]
    follower = service.cli_popen("jobs", "logs", job_id, "--follow")

    seen, restarted_at = [], None
    for event in client.events(job_id):
        seen.append(event)
        if restarted_at is None and event.event == "progress":
            # A crash of the API mid-job: both followers lose their connection and must resume.
            service.kill_api()
            time.sleep(1.0)
            service.start_api()
            restarted_at = len(seen)

    assert restarted_at is not None and len(seen) > restarted_at, "nothing arrived after the restart"
    assert seen[-1].event == "status" and seen[-1].data["status"] == "succeeded"
    # Exactly what a fresh replay of the whole job gives: nothing repeated, nothing missing.
    replay = [(e.seq, e.event) for e in service.client().events(job_id)]
    assert [(e.seq, e.event) for e in seen] == replay
    assert [s for s, _ in replay] == sorted({s for s, _ in replay})
    _, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err
    assert "status succeeded" in err and "Traceback" not in err


def test_cancel_a_running_job_and_a_finished_one(service: LiveService, sentiment_files: dict[str, str]) -> None:
    spec = job_spec(sentiment_files, "cancel-me", training={"num_train_epochs": 500})
    client = service.client()
    job_id = client.submit(spec)["id"]
    events = client.events(job_id)
    last = next(e for e in events if e.event == "progress")  # training is under way
    events.close()

    result = service.cli("jobs", "cancel", job_id)

    assert result.returncode == 0, result.stderr
    statuses = [e.data["status"] for e in client.events(job_id, last_event_id=last.id) if e.event == "status"]
    assert statuses[-1] == "cancelled"
    assert client.get(job_id)["error"]["reason"] == ErrorReason.cancelled
    # Following a cancelled job ends at once, with the cancelled exit status (as `train` does).
    assert service.cli("jobs", "logs", job_id, "--follow").returncode == exit_code("cancelled") == 3
    again = service.cli("jobs", "cancel", job_id)
    assert again.returncode == 2
    assert "Conflict (409)" in again.stderr and "Traceback" not in again.stderr


def test_uploaded_dataset_then_a_job_that_uses_it(service: LiveService, tmp_path: Path) -> None:
    files = write_sentiment_csv(tmp_path / "mine", n_train=96, n_val=8)
    upload = service.cli("datasets", "upload", files["train"], "--name", "my-reviews")
    assert upload.returncode == 0, upload.stderr
    dataset_id = upload.stdout.strip()
    assert dataset_id in service.cli("datasets", "list").stdout
    # A folder is zipped on the way and stored as an image folder.
    folder = write_image_folder(tmp_path / "images", n_train_per_class=2, n_val_per_class=1, size=8)
    images = service.client().upload_dataset(folder)
    assert images["format"] == "imagefolder"

    spec: dict[str, Any] = job_spec({"train": files["train"]}, "uploaded")
    spec["dataset"] = {"id": dataset_id, "eval_fraction": 0.25, "text_column": "text", "label_column": "label"}
    result = service.cli("submit", str(write_json(tmp_path / "job.json", spec)), "--follow")

    assert result.returncode == 0, result.stderr
    job = service.client().get(result.stdout.split()[0])
    assert job["status"] == "succeeded" and job["spec"]["dataset"]["path"] == "csv"


def test_estimate_remote_agrees_with_local(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    spec_path = str(write_json(tmp_path / "job.json", job_spec(sentiment_files, "estimate-me")))
    remote = service.cli("estimate", spec_path, "--remote", "--json")
    local = service.cli("estimate", spec_path, "--json")
    assert remote.returncode == 0 and local.returncode == 0, remote.stderr + local.stderr
    assert json.loads(remote.stdout)["total_bytes"] == json.loads(local.stdout)["total_bytes"]
    planned = service.cli("estimate", spec_path, "--remote", "--gpu-memory", "1MiB")
    assert planned.returncode == 4, planned.stderr  # nothing fits in 1 MiB
    assert "does NOT fit" in planned.stdout and "total per device" in planned.stdout


def test_errors_are_readable_lines_not_tracebacks(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    bad = job_spec(sentiment_files, "bad", training={"learning_rate": -1})
    result = service.cli("submit", str(write_json(tmp_path / "bad.json", bad)))
    assert result.returncode == 2
    assert "training.learning_rate: Input should be greater than 0" in result.stderr
    assert "Traceback" not in result.stderr

    outside = job_spec(sentiment_files, "outside")
    outside["dataset"]["data_files"]["validation"] = "/etc/passwd"
    result = service.cli("submit", str(write_json(tmp_path / "outside.json", outside)))
    assert result.returncode == 2
    assert "dataset.data_files.validation: local paths must be under the data root" in result.stderr

    cases = [
        (service.cli("jobs", "list", key="tj_wrong"), "Unauthorized (401)"),
        (service.cli("jobs", "show", "no-such-job"), "Not Found (404)"),
        (service.cli("submit", str(tmp_path / "missing.json")), "no such file"),
        (service.cli("jobs", "list", "--url", "http://127.0.0.1:9"), "cannot reach"),
    ]
    for outcome, message in cases:
        assert outcome.returncode == 2 and message in outcome.stderr, outcome.stderr
        assert "Traceback" not in outcome.stderr

    # The same errors from Python: the problem+json, field by field.
    with pytest.raises(ApiError) as caught:
        service.client().submit(job_spec(sentiment_files, "bad", training={"learning_rate": -1}))
    assert caught.value.status == 422
    assert [e["field"] for e in caught.value.errors] == ["training.learning_rate"]
