"""The full path, with real parts: API (uvicorn) + Celery worker process + a real tiny training, on
PostgreSQL + Redis and on the embedded default (SQLite + the SQLAlchemy/SQLite broker).

submit -> queued -> running -> succeeded; metrics in order over SSE and by polling; an SSE reconnect
with Last-Event-ID resumes without gaps or repeats; artifacts list and download, the downloaded
model loads and predicts; the measured optimizer state equals the estimate's; cancel over the API.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select

from service_core.db import JobEvent
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason
from tests.trainer_core.datagen import write_sentiment_csv
from worker.procfs import cmdline
from worker.zygote import MARKER

from .conftest import create_pg_database, drop_pg_database, group_members, make_settings, quick_spec
from .live import LiveService, live_service, processes_mentioning, read_sse, start_worker, stop

pytestmark = pytest.mark.slow
REDIS_DB = 13  # these tests' own Redis database; queue names are unique per run as well


def redis_cleanup(queue: str) -> None:
    client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    for key in client.scan_iter(match=f"*{queue}*"):
        client.delete(key)


PRICE = 2.0  # each service's queue's price per device-hour


@contextmanager
def started_service(kind: str, tmp_path: Path, **env: str) -> Iterator[LiveService]:
    """A live service on the embedded default or on PostgreSQL + Redis, each with fresh state (and ``env``)."""
    home = tmp_path / "var"
    home.mkdir()
    queue = f"e2e-{uuid.uuid4().hex[:8]}"
    env = {"TRAINJOBS_QUEUE_PRICES": json.dumps({queue: PRICE}), **env}
    if kind == "embedded":
        with live_service(make_settings(home, **env), queue, tmp_path / "logs") as live:
            yield live
        return
    name, url = create_pg_database("trainjobs_e2e")
    settings = make_settings(home, DATABASE_URL=url, BROKER_URL=f"redis://127.0.0.1:6379/{REDIS_DB}", **env)
    try:
        with live_service(settings, queue, tmp_path / "logs") as live:
            yield live
    finally:
        redis_cleanup(queue)
        drop_pg_database(name)


@pytest.fixture(params=["embedded", "postgres-redis"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveService]:
    with started_service(request.param, tmp_path) as live:
        yield live


@pytest.fixture
def redis_service(tmp_path: Path) -> Iterator[LiveService]:
    with started_service("postgres-redis", tmp_path) as live:
        yield live


def data_files(settings: Settings) -> dict[str, str]:
    # Jobs may read local paths only under the data root.
    return write_sentiment_csv(settings.data_root / "sentiment", n_train=64, n_val=16)


def wait_status(client: Any, job_id: str, wanted: set[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in wanted:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} not in {wanted} after {timeout}s: {job}")


def poll_metrics(client: Any, job_id: str, timeout: float) -> list[dict[str, Any]]:
    """Page through /metrics with ``after`` while the job runs, until it is over and drained."""
    points: list[dict[str, Any]] = []
    after, deadline = 0, time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = client.get(f"/v1/jobs/{job_id}").json()["status"]
        page = client.get(f"/v1/jobs/{job_id}/metrics", params={"after": after, "limit": 7}).json()
        points.extend(page["items"])
        after = page["next_after"]
        if status in ("succeeded", "failed", "cancelled") and not page["has_more"] and not page["items"]:
            return points
        if not page["has_more"]:
            time.sleep(0.2)
    raise AssertionError("metrics polling did not finish")


def test_submit_run_stream_and_download(service: LiveService, tmp_path: Path) -> None:
    spec = quick_spec(data_files(service.settings), num_train_epochs=2)
    with service.client(timeout=30) as client:
        created = client.post("/v1/jobs", json={**spec, "queue": service.queue, "priority": 5})
        assert created.status_code == 201, created.text
        job = created.json()
        job_id = job["id"]
        assert job["status"] == "queued" and job["queue"] == service.queue

        # Live SSE: read a few frames, drop the connection, reconnect with Last-Event-ID.
        with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=90) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            first = read_sse(response, limit=6)
        assert len(first) == 6
        with client.stream(
            "GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(first[-1]["id"])}, timeout=90
        ) as response:
            rest = read_sse(response)
        polled = poll_metrics(client, job_id, timeout=60)
        final = wait_status(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=10)
        assert final["status"] == "succeeded", final["error"]

        frames = first + rest
        ids = [f["id"] for f in frames]
        assert ids == list(range(ids[0], ids[0] + len(ids)))  # no gap, no repeat across the reconnect
        with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=30) as response:
            replay = read_sse(response)  # a finished job's stream replays everything and ends
        assert [f["id"] for f in replay] == list(range(1, len(replay) + 1))
        assert [(f["id"], f["event"]) for f in replay][-len(frames):] == [(f["id"], f["event"]) for f in frames]
        statuses = [f["data"]["status"] for f in replay if f["event"] == "status"]
        assert statuses == ["running", "succeeded"]  # after the queued job was picked up
        sse_losses = [(f["data"]["step"], f["data"]["values"]["loss"]) for f in replay if f["event"] == "metric"]
        assert [step for step, _ in sse_losses] == list(range(1, 17))
        assert any(f["event"] == "eval" for f in replay) and any(f["event"] == "memory" for f in replay)

        polled_losses = [(p["step"], p["value"]) for p in polled if p["name"] == "loss"]
        assert polled_losses == sse_losses  # same points, same order, both ways
        assert [p["seq"] for p in polled] == sorted(p["seq"] for p in polled)

        # The estimate was right about the optimizer, to the byte.
        assert final["memory"]["measured"]["optimizer_state_bytes"] == final["estimate"]["optimizer_state_bytes"]
        assert final["progress"]["step"] == 16 and final["attempts"] == 1

        # Charged its one attempt at its queue's price, and summed by GET /v1/usage (a fresh database:
        # this job alone), on both database shapes.
        usage = final["usage"]
        ran = datetime.fromisoformat(final["finished_at"]) - datetime.fromisoformat(final["started_at"])
        assert usage["run_seconds"] == pytest.approx(ran.total_seconds(), abs=1e-3) and usage["run_seconds"] > 0
        assert usage["cost"] == pytest.approx(usage["device_hours"] * PRICE)
        report = client.get("/v1/usage", params={"group_by": "queue"}).json()
        assert [(g["key"], g["jobs"]) for g in report["groups"]] == [(service.queue, {"succeeded": 1})]
        assert report["total"]["device_hours"] == pytest.approx(usage["device_hours"])
        assert report["total"]["cost"] == pytest.approx(usage["cost"])

        listing = {item["path"] for item in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
        assert {"model.safetensors", "config.json", "metrics.json", "worker.log", "tokenizer.json"} <= listing
        model_dir = tmp_path / "downloaded"
        model_dir.mkdir()
        for name in sorted(p for p in listing if "/" not in p):
            got = client.get(f"/v1/jobs/{job_id}/artifacts/{name}")
            assert got.status_code == 200
            (model_dir / name).write_bytes(got.content)

    predict_with(model_dir)
    assert processes_mentioning(str(service.settings.home / "runs")) == []  # the run is gone


def predict_with(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert set(model.config.id2label.values()) == {"negative", "positive"}
    with torch.no_grad():
        logits = model(**tokenizer(["the movie was wonderful.", "the food was awful."], return_tensors="pt",
                                   padding=True)).logits
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


def test_cancel_queued_running_and_finished_jobs(redis_service: LiveService) -> None:
    service = redis_service
    files = data_files(service.settings)
    with service.client(timeout=30) as client:
        running = client.post("/v1/jobs", json={**quick_spec(files, num_train_epochs=200), "queue": service.queue})
        # Nobody consumes this queue: the job stays queued until cancelled.
        queued = client.post("/v1/jobs", json={**quick_spec(files), "queue": f"{service.queue}-idle"})
        assert running.status_code == 201 and queued.status_code == 201
        running_id, queued_id = running.json()["id"], queued.json()["id"]

        assert client.post(f"/v1/jobs/{queued_id}/cancel").status_code == 202
        cancelled_queued = client.get(f"/v1/jobs/{queued_id}").json()
        assert cancelled_queued["status"] == "cancelled"

        wait_status(client, running_id, {"running"}, timeout=60)
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{running_id}").json()["progress"]["step"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        pgid = int((service.settings.home / "runs" / running_id / "run.pid").read_text())
        # The slot forked the run from its pre-imported parent (worker/forkserver.py), not a new interpreter.
        assert MARKER.encode() in cmdline(pgid)
        assert client.post(f"/v1/jobs/{running_id}/cancel").status_code == 202
        job = wait_status(client, running_id, {"cancelled", "failed", "succeeded"}, timeout=60)
        assert job["status"] == "cancelled"
        # One name for one end state, however far the job had got.
        assert job["error"]["reason"] == cancelled_queued["error"]["reason"] == ErrorReason.cancelled
        assert group_members(pgid) == []  # the training process group is gone
        assert client.post(f"/v1/jobs/{running_id}/cancel").status_code == 409
    redis_cleanup(f"{service.queue}-idle")


def requeue_event(settings: Settings, job_id: str) -> dict[str, Any]:
    """The data of the job's status event that put it back on the queue."""
    with session_scope(settings.database_url) as s:
        rows = s.execute(select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "status")).scalars()
        return next(data for data in rows if data["status"] == "queued")


def test_worker_shutdown_requeues_and_a_new_worker_resumes(tmp_path: Path) -> None:
    """Stopping the worker (SIGTERM, like Ctrl-C in `trainjobs dev`) checkpoints the running job and
    puts it back on the queue; the next worker resumes it from the checkpoint to success."""
    with started_service("embedded", tmp_path) as service, service.client(timeout=30) as client:
        # Long enough (tiny steps take ~20 ms) that the worker's shutdown lands mid-run on any machine.
        spec = quick_spec(data_files(service.settings), num_train_epochs=50, eval_strategy="no")
        job_id = client.post("/v1/jobs", json={**spec, "queue": service.queue}).json()["id"]
        deadline = time.monotonic() + 60
        while client.get(f"/v1/jobs/{job_id}").json()["progress"]["step"] < 3:
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        stop(service.worker, 60)
        assert service.worker.returncode == 0
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert (job["status"], job["attempts"]) == ("queued", 1)
        assert requeue_event(service.settings, job_id)["reason"] == ErrorReason.shutdown_requeue
        assert processes_mentioning(str(service.settings.home / "runs")) == []
        stopped_at, total = job["progress"]["step"], job["progress"]["total"]
        assert total == 400  # 50 epochs x 8 optimizer steps
        assert 3 <= stopped_at < total

        restarted = start_worker(service)
        try:
            final = wait_status(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=90)
        finally:
            stop(restarted, 60)
        assert (final["status"], final["attempts"], final["progress"]["step"]) == ("succeeded", 2, total)
        steps = [p["step"] for p in poll_metrics(client, job_id, 10) if p["name"] == "loss"]
        assert steps == list(range(1, total + 1))  # resumed from the checkpoint: no step twice
