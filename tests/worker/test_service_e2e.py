"""The full path, with real parts: API (uvicorn) + Celery worker processes + real tiny training, on
PostgreSQL + Redis and on the embedded default (SQLite + the SQLAlchemy/SQLite broker).

submit -> queued -> running -> succeeded; metrics in order over SSE and by polling; an SSE reconnect
with Last-Event-ID resumes without gaps or repeats; artifacts list and download, the downloaded
model loads and predicts; the measured optimizer state equals the estimate's; cancel over the API;
the running-jobs cap; a QLoRA chat fine-tune whose adapter loads with PEFT; a run reporting to W&B
and MLflow, its links on the job.

The tests share one live service per shape (the ``service`` fixture: an API, two worker processes, a
slot each). A worker's shutdown, which puts its running job back on the queue from a checkpoint for
the next worker to finish, is checked through ``trainjobs dev`` (tests/trainjobs/test_dev_launcher.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

from service_core.db.session import session_scope
from service_core.keys import create_api_key
from service_core.settings import Settings
from service_core.status import TERMINAL_STATUSES, ErrorReason
from tests.mlflow_server import MlflowServer
from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainer_core.llm_data import lm_spec, write_lm_jsonl, write_lm_tokenizer
from tests.trainer_core.test_trackers import wandb_history, wandb_records
from worker.procfs import cmdline
from worker.zygote import MARKER

from .conftest import create_pg_database, drop_pg_database, group_members, make_settings, quick_spec
from .live import LiveService, live_service, processes_mentioning, read_sse, start_worker

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


@pytest.fixture(scope="module", params=["embedded", "postgres-redis"])
def service(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    """One live service per shape for the tests below that kill nothing: each makes and reads its own
    jobs, one test at a time (pytest runs this module's tests in file order on each shape).

    Two worker processes (a slot each) and a cap of one running job per owner, for the running-cap
    test; the others run one job of alice's at a time, which neither setting changes. For the trackers
    test: W&B's settings in the workers' environment (offline, a directory, a key), which a run gets
    only when its spec reports to W&B (worker/run_env.py), and private tracker addresses allowed."""
    tmp = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as patch:
        wandb = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir(tmp)), "WANDB_API_KEY": "x" * 40}
        for name, value in wandb.items():
            patch.setenv(name, value)
        with started_service(
            request.param, tmp, TRAINJOBS_MAX_RUNNING_PER_OWNER="1", TRAINJOBS_ALLOW_PRIVATE_TARGETS="true"
        ) as live:
            start_worker(live)
            yield live


def wandb_dir(service_tmp: Path) -> Path:
    """Where the runs of a ``service`` rooted at ``service_tmp`` write their offline W&B files."""
    return service_tmp / "wandb"


def data_files(settings: Settings) -> dict[str, str]:
    # Jobs may read local paths only under the data root.
    return write_sentiment_csv(settings.data_root / "sentiment", n_train=64, n_val=16)


def wait_status(client: Any, job_id: str, wanted: Collection[str], timeout: float) -> dict[str, Any]:
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
        if status in TERMINAL_STATUSES and not page["has_more"] and not page["items"]:
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
        final = wait_status(client, job_id, TERMINAL_STATUSES, timeout=10)
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

        # Charged its one attempt at its queue's price, and summed by GET /v1/usage (this test runs
        # first on its shape's fresh database: this job alone), on both database shapes.
        usage = final["usage"]
        ran = datetime.fromisoformat(final["finished_at"]) - datetime.fromisoformat(final["started_at"])
        assert usage["run_seconds"] == pytest.approx(ran.total_seconds(), abs=1e-3) and usage["run_seconds"] > 0
        assert usage["cost"] == pytest.approx(usage["device_hours"] * PRICE)
        report = client.get("/v1/usage", params={"group_by": "queue"}).json()
        assert [(g["key"], g["jobs"]) for g in report["groups"]] == [(service.queue, {"succeeded": 1})]
        assert report["total"]["device_hours"] == pytest.approx(usage["device_hours"])
        assert report["total"]["cost"] == pytest.approx(usage["cost"])

        model_dir = download_artifacts(client, job_id, tmp_path / "downloaded")
        assert {"model.safetensors", "config.json", "metrics.json", "worker.log", "tokenizer.json"} <= {
            path.name for path in model_dir.iterdir()
        }

    predict_with(model_dir)
    assert processes_mentioning(str(service.settings.home / "runs")) == []  # the run is gone


def download_artifacts(client: Any, job_id: str, folder: Path) -> Path:
    """Every top-level artifact of the job, listed and downloaded one by one through the API into ``folder``."""
    listing = {item["path"] for item in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
    folder.mkdir()
    for name in sorted(p for p in listing if "/" not in p):
        got = client.get(f"/v1/jobs/{job_id}/artifacts/{name}")
        assert got.status_code == 200, (name, got.text)
        (folder / name).write_bytes(got.content)
    return folder


def predict_with(model_dir: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert set(model.config.id2label.values()) == {"negative", "positive"}
    with torch.no_grad():
        logits = model(**tokenizer(["the movie was wonderful.", "the food was awful."], return_tensors="pt",
                                   padding=True)).logits
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()


@pytest.mark.parametrize("service", ["postgres-redis"], indirect=True)
def test_cancel_queued_running_and_finished_jobs(service: LiveService) -> None:
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
        job = wait_status(client, running_id, TERMINAL_STATUSES, timeout=60)
        assert job["status"] == "cancelled"
        # One name for one end state, however far the job had got.
        assert job["error"]["reason"] == cancelled_queued["error"]["reason"] == ErrorReason.cancelled
        assert group_members(pgid) == []  # the training process group is gone
        assert client.post(f"/v1/jobs/{running_id}/cancel").status_code == 409
    redis_cleanup(f"{service.queue}-idle")


def wait_warmed_up(client: httpx.Client, timeout: float = 600) -> None:
    """Until the API has imported the training stack (a submit meanwhile may meet it half-imported on a
    loaded machine, see api/preflight.py; it waits at most 10 s for those imports)."""
    deadline = time.monotonic() + timeout
    while not client.get("/readyz").json().get("warmed_up"):
        assert time.monotonic() < deadline, "the API did not warm up"
        time.sleep(0.5)


def test_an_owners_second_job_waits_for_its_first_while_others_start(service: LiveService) -> None:
    """With a cap of 1, an owner's second job waits in the queue (saying why) until its first ends,
    while another owner's job starts on the free slot meanwhile."""
    with session_scope(service.settings.database_url) as session:
        bob_key = create_api_key(session, "bob", settings=service.settings)
    files = data_files(service.settings)
    short = {**quick_spec(files), "queue": service.queue}
    bob = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {bob_key}"}, timeout=120)
    with service.client(timeout=120) as alice, bob:
        wait_warmed_up(alice)
        # Long enough to outlast everything below; cancelled at the end.
        created = alice.post("/v1/jobs", json={**quick_spec(files, num_train_epochs=200), "queue": service.queue})
        assert created.status_code == 201, created.text
        long_id = created.json()["id"]
        wait_status(alice, long_id, {"running"}, timeout=120)
        second = alice.post("/v1/jobs", json=short)  # submitting over the cap is not refused
        bobs = bob.post("/v1/jobs", json=short)
        assert (second.status_code, bobs.status_code) == (201, 201), second.text + bobs.text
        second_id, bobs_id = second.json()["id"], bobs.json()["id"]

        bobs_job = wait_status(bob, bobs_id, TERMINAL_STATUSES, timeout=180)  # ran on the free slot meanwhile
        assert bobs_job["status"] == "succeeded"
        held = alice.get(f"/v1/jobs/{second_id}").json()
        assert (held["status"], held["attempts"]) == ("queued", 0)
        assert "TRAINJOBS_MAX_RUNNING_PER_OWNER=1" in held["waiting"]
        assert alice.get(f"/v1/jobs/{long_id}").json()["status"] == "running"

        assert alice.post(f"/v1/jobs/{long_id}/cancel").status_code == 202
        first = wait_status(alice, long_id, TERMINAL_STATUSES, timeout=120)
        ran = wait_status(alice, second_id, TERMINAL_STATUSES, timeout=180)
    assert (first["status"], ran["status"], ran["waiting"]) == ("cancelled", "succeeded", None)
    assert ran["started_at"] >= first["finished_at"]  # never two of alice's jobs at once
    assert bobs_job["started_at"] < first["finished_at"]


LM_TRAINING = {"max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-2,
               "eval_strategy": "steps", "eval_steps": 4, "save_steps": 1000}  # fmt: skip


@pytest.mark.parametrize("service", ["embedded"], indirect=True)
def test_a_qlora_job_streams_metrics_and_its_adapter_loads(service: LiveService, tmp_path: Path) -> None:
    """A QLoRA chat fine-tune through the whole service: its metrics streamed over SSE, its 4-bit base
    sized to the byte, its adapter downloaded and loaded with PEFT."""
    from peft import PeftModel

    from trainer_core.adapters import build_base_model
    from trainer_core.spec import parse_spec

    root = service.settings.data_root / "lm"  # jobs read local paths under the data root only
    files, tokenizer = write_lm_jsonl(root / "data", "chat"), write_lm_tokenizer(root / "tok")
    spec = lm_spec(files, tokenizer, adapter={"type": "qlora", "r": 8, "compute_dtype": "fp32"}, training=LM_TRAINING)
    with service.client(timeout=120) as client:  # a submit loads the tokenizer
        wait_warmed_up(client)
        created = client.post("/v1/jobs", json={**spec, "queue": service.queue})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=600) as response:
            frames = read_sse(response)  # ends when the job does
        final = wait_status(client, job_id, TERMINAL_STATUSES, timeout=30)
        assert final["status"] == "succeeded", final["error"]
        assert [f["data"]["step"] for f in frames if f["event"] == "metric"] == [1, 2, 3, 4]
        (evaluation,) = [f["data"]["values"] for f in frames if f["event"] == "eval"]
        assert set(evaluation) == {"eval_loss", "eval_perplexity"}
        measured, estimate = final["memory"]["measured"], final["estimate"]
        assert measured["parameter_bytes"] == estimate["parameter_bytes"]  # the 4-bit base, to the byte
        assert measured["optimizer_state_bytes"] == estimate["optimizer_state_bytes"]
        listing = {item["path"] for item in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
        assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= listing
        model_dir = tmp_path / "downloaded"
        model_dir.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            got = client.get(f"/v1/jobs/{job_id}/artifacts/{name}")
            assert got.status_code == 200
            (model_dir / name).write_bytes(got.content)

    job_spec = parse_spec(spec)
    torch.manual_seed(job_spec.training.seed)
    model = PeftModel.from_pretrained(build_base_model(job_spec, []), str(model_dir)).eval()
    with torch.no_grad():
        generated = model.generate(input_ids=torch.tensor([[2, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)


@pytest.mark.parametrize("service", ["embedded"], indirect=True)
def test_a_job_reports_to_wandb_and_mlflow_and_shows_their_links(
    service: LiveService, mlflow_tracking: MlflowServer
) -> None:
    """W&B and MLflow through the whole service: the spec's MLflow server is on this machine (allowed by
    TRAINJOBS_ALLOW_PRIVATE_TARGETS). The run's links land in ``jobs.tracker_links`` and come back on
    ``GET /v1/jobs/{id}``; both trackers hold the job's own metric points."""
    from mlflow import MlflowClient

    files = write_sentiment_csv(service.settings.data_root / "trackers", n_train=32, n_val=8)
    spec = quick_spec(files, report_to=["wandb", "mlflow"], eval_strategy="steps", eval_steps=2)
    experiment = f"e2e-{uuid.uuid4().hex[:8]}"
    spec["integrations"] = {"mlflow": {"tracking_uri": mlflow_tracking.url, "experiment": experiment}}
    with service.client(timeout=30) as client:
        created = client.post("/v1/jobs", json={**spec, "queue": service.queue})
        assert created.status_code == 201, created.text
        job = wait_status(client, created.json()["id"], TERMINAL_STATUSES, timeout=240)
        assert job["status"] == "succeeded", job["error"]
        points = client.get(f"/v1/jobs/{job['id']}/metrics", params={"limit": 1000}).json()["items"]

    expected: dict[str, list[tuple[int, float]]] = {}
    for point in points:
        expected.setdefault(point["name"], []).append((point["step"], point["value"]))
    links = job["tracker_links"]
    assert set(links) == {"wandb", "mlflow"}

    runs_dir = wandb_dir(service.settings.home.parent)
    assert links["wandb"]["url"] is None and links["wandb"]["dir"].startswith(str(runs_dir))
    (run_file,) = runs_dir.rglob(f"run-{links['wandb']['run_id']}.wandb")
    assert wandb_history(wandb_records(run_file)) == expected

    mlflow = MlflowClient(tracking_uri=mlflow_tracking.url)
    run = mlflow.get_run(links["mlflow"]["run_id"])
    page = f"{mlflow_tracking.url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    assert links["mlflow"]["url"] == page
    assert run.info.status == "FINISHED" and run.data.params["name"] == spec["name"]
    for name, want in expected.items():
        got = sorted((m.step, m.value) for m in mlflow.get_metric_history(run.info.run_id, name))
        assert got == want, name
