"""Real runs under the supervisor: success with artifacts, cancel that kills the whole process group,
failures recorded with their real reason. (Worker shutdown and resume: tests/trainjobs/test_dev_launcher.py.)"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from sqlalchemy import select, update

from service_core.artifacts import ArtifactStore
from service_core.db import Job, JobEvent, MetricPoint
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason
from trainer_core.checkpoint import newest_checkpoint
from trainer_core.events import make_event
from worker.execute import execute_job
from worker.outcome import classify_exit
from worker.paths import run_paths

from .conftest import JobFactory, group_members, load_job, quick_spec


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_in_thread(job_id: str, settings: Settings, **kwargs: Any) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(status=execute_job(job_id, settings, **kwargs)))
    thread.start()
    return thread, result


def test_a_run_succeeds_with_metrics_memory_and_artifacts(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    # A remote (fsspec) artifacts root: the run works in a local dir and is uploaded at the end.
    remote = sqlite_settings.model_copy(update={"artifacts_root_": f"memory://trainjobs-{uuid.uuid4().hex}"})
    job_id = make_job(remote, quick_spec(sentiment_files))
    assert execute_job(job_id, remote) == "succeeded"
    job = load_job(remote, job_id)
    assert (job.status, job.attempts, job.progress_step, job.progress_total) == ("succeeded", 1, 8, 8)
    assert job.final_metrics is not None and "eval_accuracy" in job.final_metrics
    assert job.measured_memory is not None and job.measured_memory["optimizer_state_bytes"] > 0
    with session_scope(remote.database_url) as s:
        losses = s.execute(
            select(MetricPoint.step).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
            .order_by(MetricPoint.seq)
        ).scalars().all()
        kinds = s.execute(select(JobEvent.kind).where(JobEvent.job_id == job_id)).scalars().all()
    assert losses == list(range(1, 9))
    assert {"status", "progress", "metric", "eval", "memory"} <= set(kinds)
    files = {f["path"] for f in ArtifactStore(remote.artifacts_root).list(job_id)}
    assert {"model.safetensors", "config.json", "metrics.json", "worker.log"} <= files
    work_output = run_paths(job_id, remote).output_dir
    assert newest_checkpoint(work_output) is not None  # the run checkpointed locally ...
    assert not any(f.startswith("checkpoint-") for f in files)  # ... and checkpoints stay behind


def test_cancel_stops_the_run_and_its_whole_process_group(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    # A dataloader worker process gives the run a child that must go too.
    spec = quick_spec(sentiment_files, num_train_epochs=200, dataloader_num_workers=1)
    job_id = make_job(sqlite_settings, spec)
    thread, result = start_in_thread(job_id, sqlite_settings)
    paths = run_paths(job_id, sqlite_settings)
    wait_for(lambda: load_job(sqlite_settings, job_id).progress_step >= 2, 90, "the run to make progress")
    pgid = int(paths.pid_file.read_text())
    # the run and its dataloader worker (workers come and go with each epoch's loader: poll)
    wait_for(lambda: len(group_members(pgid)) >= 2, 30, "the dataloader worker to start")
    with session_scope(sqlite_settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    thread.join(60)
    assert not thread.is_alive()
    assert result["status"] == "cancelled"
    job = load_job(sqlite_settings, job_id)
    # The same reason as a job cancelled while queued (tests/api/test_jobs.py).
    assert (job.status, job.error_reason) == ("cancelled", ErrorReason.cancelled)
    assert job.progress_total is not None and job.progress_step < job.progress_total  # stopped early
    assert group_members(pgid) == []
    assert newest_checkpoint(paths.output_dir) is not None  # SIGTERM made it checkpoint first


def test_cancel_past_the_grace_period_kills_the_group(
    tmp_path: Any, make_job: JobFactory, sentiment_files: dict[str, str], sqlite_settings: Settings
) -> None:
    settings = sqlite_settings.model_copy(update={"cancel_grace_seconds": 0.0})
    job_id = make_job(settings, quick_spec(sentiment_files, num_train_epochs=200))
    thread, result = start_in_thread(job_id, settings)
    wait_for(lambda: load_job(settings, job_id).progress_step >= 1, 90, "the run to make progress")
    pgid = int(run_paths(job_id, settings).pid_file.read_text())
    with session_scope(settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    thread.join(30)
    assert result["status"] == "cancelled"
    assert group_members(pgid) == []


def test_missing_data_file_fails_with_the_runs_reason(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], tmp_path: Any
) -> None:
    missing = str(tmp_path / "nowhere" / "missing-train.csv")
    spec = quick_spec({"train": missing, "validation": sentiment_files["validation"]})
    job_id = make_job(sqlite_settings, spec)
    assert execute_job(job_id, sqlite_settings) == "failed"
    job = load_job(sqlite_settings, job_id)
    assert job.error_reason == "data_error"  # the run's own reason, from its done event
    assert job.error_message is not None
    assert "dataset.data_files" in job.error_message and "missing-train.csv" in job.error_message
    files = {f["path"] for f in ArtifactStore(sqlite_settings.artifacts_root).list(job_id)}
    assert "worker.log" in files


def test_a_run_without_done_event_is_an_internal_failure(sqlite_settings: Settings, make_job: JobFactory) -> None:
    # The CLI refuses this spec before training (exit 2, no done event): what a crash looks like.
    job_id = make_job(sqlite_settings, {"name": "broken", "task": "text-classification", "bogus_field": 1})
    assert execute_job(job_id, sqlite_settings) == "failed"
    job = load_job(sqlite_settings, job_id)
    assert job.error_reason == ErrorReason.internal
    assert job.error_message is not None and "exited with code 2" in job.error_message
    assert "bogus_field" in job.error_message  # the tail of stderr


def test_out_of_memory_is_recognised_with_the_estimate_beside_it() -> None:
    done = make_event("done", status="failed", summary={
        "reason": "out_of_memory",
        "error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total)"})
    outcome = classify_exit(done, 1, None, "", {"total_bytes": 3 * 2**30})
    assert (outcome.status, outcome.reason) == ("failed", "out_of_memory")
    assert outcome.message is not None
    assert "Tried to allocate 2.00 GiB" in outcome.message and "estimated 3.00 GiB" in outcome.message
    # killed mid-step by the allocator, no done event: the stderr tail tells
    tail = "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB"
    crashed = classify_exit(None, 1, None, tail, None)
    assert (crashed.status, crashed.reason) == ("failed", "out_of_memory")
