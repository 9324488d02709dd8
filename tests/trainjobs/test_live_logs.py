"""``trainjobs jobs logs ID --output``: the run process's own output, paged and followed, against a live service."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService

pytestmark = pytest.mark.slow


def test_output_follows_the_run_to_its_end_then_pages(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    client = service.client()
    job_id = client.submit(job_spec(sentiment_files, "output-me"))["id"]

    # Started while the job is queued: it streams as the run writes and ends when the job does.
    followed = service.cli("jobs", "logs", job_id, "--output", "--follow")

    assert followed.returncode == 0, followed.stderr
    assert client.get(job_id)["status"] == "succeeded"
    stored = client.download(job_id, "worker.log", tmp_path / "log").read_bytes().decode()
    # The run's stderr (here the final save's progress bar) reaches the terminal, all of it, once.
    assert "Writing model shards" in stored
    # (Line by line: the captured stdout has its progress bars' carriage returns turned into newlines.)
    assert followed.stdout.splitlines() == stored.splitlines()

    # Without --follow: the stored log, paged by offset until `complete` (small pages: several of them).
    assert service.cli("jobs", "logs", job_id, "--output").stdout.splitlines() == stored.splitlines()
    pages = list(client.log_text(job_id, limit=64))
    assert len(pages) > 2 and "".join(pages) == stored
    # The event view is still the default.
    assert "status succeeded" in service.cli("jobs", "logs", job_id).stdout


def test_output_follow_resumes_across_an_api_restart(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    client = service.client()
    spec = job_spec(sentiment_files, "output-restart", training={"num_train_epochs": 4, "logging_steps": 1})
    job_id = client.submit(spec)["id"]
    follower = service.cli_popen("jobs", "logs", job_id, "--output", "--follow")

    events = client.events(job_id)
    next(e for e in events if e.event == "progress")  # the run is under way, the follower connected
    events.close()
    service.kill_api()  # a crash: the follower's stream is cut and must resume from its byte offset
    time.sleep(1.0)
    service.start_api()

    out, err = follower.communicate(timeout=180)
    assert follower.returncode == 0, err
    assert client.get(job_id)["status"] == "succeeded"
    stored = client.download(job_id, "worker.log", tmp_path / "log").read_bytes().decode()
    # Nothing repeated, nothing missing across the reconnection.
    assert out.splitlines() == stored.splitlines() and "Writing model shards" in out
