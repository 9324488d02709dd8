"""Jobs left running by a dead slot are requeued (from their newest checkpoint, on the disk or in the
object store, or from step 0) while they have restarts left, else failed; never left running. Jobs
whose slot is alive are left alone. Every requeue says where the job resumes from what is really there,
and a job that fails instead claims no resume."""

from __future__ import annotations

import logging
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from kombu import Connection
from sqlalchemy import select, update

from service_core.checkpoints import CheckpointStore
from service_core.db import Job, JobEvent
from service_core.db.base import utcnow
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.checkpoint import TrainProgress, checkpoint_dir, write_meta
from trainer_core.spec import parse_spec
from worker.execute import requeue_after_shutdown, restart
from worker.outcome import RunOutcome
from worker.paths import host_name, run_paths
from worker.procfs import cmdline
from worker.recovery import recover_orphaned_jobs

from .conftest import JobFactory, load_job, quick_spec


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def write_checkpoint(output_dir: Path, spec: dict) -> None:
    """A checkpoint folder described the way the trainer describes its own."""
    ckpt = checkpoint_dir(output_dir, 4)
    ckpt.mkdir(parents=True)
    write_meta(ckpt, parse_spec(spec), TrainProgress(global_step=4, epoch=0, batch_in_epoch=4), "trainer")


def queued_ids(settings: Settings, queue: str) -> list[str]:
    ids: list[str] = []
    with Connection(settings.broker_url) as conn, conn.SimpleQueue(queue) as q:
        while True:
            try:
                message = q.get(timeout=1)
            except q.Empty:
                return ids
            ids.append(message.payload[0][0])
            message.ack()


def test_orphans_are_requeued_or_failed_and_live_jobs_left_alone(
    db_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    spec = quick_spec(sentiment_files)
    host = host_name()
    with_ckpt = make_job(db_settings, spec, status="running", attempts=1, worker=host, pid=dead_pid(), queue="q-rec")
    without = make_job(db_settings, spec, status="running", attempts=1, worker=host, pid=dead_pid(), queue="q-rec")
    no_restarts = {**spec, "resources": {"max_restarts": 0}}
    spent = make_job(db_settings, no_restarts, status="running", attempts=1, worker=host, pid=dead_pid())
    alive = make_job(db_settings, spec, status="running", attempts=1, worker=host, pid=1)  # pid 1 is always there
    elsewhere = make_job(db_settings, spec, status="running", attempts=1, worker="other-host", pid=1)
    stale = make_job(db_settings, no_restarts, status="running", attempts=1, worker="other-host", pid=1)
    with session_scope(db_settings.database_url) as s:
        s.execute(update(Job).where(Job.id == stale).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    write_checkpoint(run_paths(with_ckpt, db_settings).output_dir, spec)

    results = recover_orphaned_jobs(db_settings)

    assert results == {with_ckpt: "queued", without: "queued", spent: "failed", stale: "failed"}
    requeued = load_job(db_settings, with_ckpt)
    assert (requeued.status, requeued.attempts, requeued.worker) == ("queued", 1, None)
    assert "runs again from checkpoint-4, restart 1 of 2" in last_status_message(db_settings, with_ckpt)
    # No checkpoint yet but restarts left: it starts over rather than failing.
    assert load_job(db_settings, without).status == "queued"
    assert "runs again from the start (no checkpoint yet)" in last_status_message(db_settings, without)
    for lost in (spent, stale):
        job = load_job(db_settings, lost)
        assert (job.status, job.error_reason) == ("failed", "worker_lost")
        assert "no restarts left: resources.max_restarts is 0" in (job.error_message or "")
    assert load_job(db_settings, alive).status == "running"
    assert load_job(db_settings, elsewhere).status == "running"
    assert sorted(queued_ids(db_settings, "q-rec")) == sorted([with_ckpt, without])  # re-enqueued to their queue
    assert recover_orphaned_jobs(db_settings) == {}  # nothing left to recover


def last_status_message(settings: Settings, job_id: str) -> str:
    with session_scope(settings.database_url) as session:
        data = session.execute(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "status")
            .order_by(JobEvent.seq.desc()).limit(1)
        ).scalar_one()  # fmt: skip
    return str(data.get("message") or "")


def test_on_an_object_store_root_the_sweep_looks_for_checkpoints_in_the_store(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], s3_root: str, tmp_path: Path
) -> None:
    # The lost host's disk is gone: only the store tells whether the job has a checkpoint.
    settings = sqlite_settings.model_copy(update={"artifacts_root_": s3_root})
    spec = quick_spec(sentiment_files)
    stored, never = (make_job(settings, spec, status="running", attempts=1, worker="gone-host", pid=1,
                              lease_expires_at=utcnow() - timedelta(seconds=1)) for _ in range(2))  # fmt: skip
    write_checkpoint(tmp_path / "lost-disk", spec)
    assert CheckpointStore(s3_root, stored).upload(checkpoint_dir(tmp_path / "lost-disk", 4), 4, attempt=1)

    assert recover_orphaned_jobs(settings) == {stored: "queued", never: "queued"}
    assert "runs again from checkpoint-4" in last_status_message(settings, stored)
    assert "runs again from the start (no checkpoint yet)" in last_status_message(settings, never)


def test_a_leftover_run_of_a_dead_supervisor_is_killed(sqlite_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(sqlite_settings, {"resources": {"max_restarts": 0}}, status="running", worker=host_name(),
                      pid=dead_pid())  # fmt: skip
    paths = run_paths(job_id, sqlite_settings)
    paths.work_dir.mkdir(parents=True)
    # Stands in for an orphaned training process: same session trick, "trainjobs" in its command line.
    orphan = subprocess.Popen(["bash", "-c", "exec -a trainjobs-run sleep 60"], start_new_session=True)
    for _ in range(100):  # until bash has exec'd into the renamed sleep
        if cmdline(orphan.pid).startswith(b"trainjobs-run"):
            break
        time.sleep(0.05)
    paths.pid_file.write_text(str(orphan.pid))
    assert recover_orphaned_jobs(sqlite_settings) == {job_id: "failed"}
    assert orphan.wait(timeout=10) == -9
    assert not paths.pid_file.exists()


def test_a_lost_worker_spends_a_restart_and_then_the_job_fails(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    spec = {**quick_spec(sentiment_files), "resources": {"max_restarts": 1}}
    job_id = make_job(sqlite_settings, spec, status="running", attempts=1, worker=host_name(), pid=dead_pid())
    write_checkpoint(run_paths(job_id, sqlite_settings).output_dir, spec)
    assert recover_orphaned_jobs(sqlite_settings) == {job_id: "queued"}  # restart 1 of 1

    # The next attempt's worker is lost too: no restart left, even with a checkpoint to resume from.
    with session_scope(sqlite_settings.database_url) as s:
        again = {"status": "running", "attempts": 2, "worker": host_name(), "pid": dead_pid()}
        s.execute(update(Job).where(Job.id == job_id).values(**again))
    assert recover_orphaned_jobs(sqlite_settings) == {job_id: "failed"}
    job = load_job(sqlite_settings, job_id)
    assert job.error_reason == "worker_lost"
    assert "no restarts left: resources.max_restarts is 1" in (job.error_message or "")


def test_a_restart_or_a_stop_claims_a_checkpoint_resume_only_when_there_is_one(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    settings, spec = sqlite_settings, quick_spec(sentiment_files)
    with_ckpt, without, stopped, cancelled = (make_job(settings, spec, status="running", attempts=1,
                                                       worker=host_name(), pid=1) for _ in range(4))  # fmt: skip
    write_checkpoint(run_paths(with_ckpt, settings).output_dir, spec)
    with session_scope(settings.database_url) as s:
        s.execute(update(Job).where(Job.id == cancelled).values(cancel_requested=True))

    def killed() -> RunOutcome:
        return RunOutcome(JobStatus.failed, ErrorReason.worker_lost, "run killed by SIGKILL")

    with caplog.at_level(logging.INFO, logger="worker"):
        for job_id in (with_ckpt, without, cancelled):
            restarted = restart(job_id, settings, run_paths(job_id, settings), killed(), spec, attempt=1)
            assert restarted == (job_id != cancelled)
        stop = RunOutcome(JobStatus.cancelled, stopped_by=ErrorReason.shutdown_requeue)
        assert requeue_after_shutdown(stopped, settings, run_paths(stopped, settings), stop, attempt=1) == "queued"
    assert last_status_message(settings, with_ckpt) == (
        "run killed by SIGKILL; restarting from checkpoint-4, restart 1 of 2"
    )
    assert last_status_message(settings, without) == (
        "run killed by SIGKILL; restarting from the start (no checkpoint yet), restart 1 of 2"
    )
    assert last_status_message(settings, stopped) == (
        "the worker shut down while the job ran; it runs again from the start (no checkpoint yet)"
    )
    # A cancel was requested: the job fails, and neither its message nor the log promises a restart.
    failed = load_job(settings, cancelled)
    assert (failed.status, failed.error_message) == ("failed", "run killed by SIGKILL")
    for job_id in (without, stopped, cancelled):
        lines = [r.getMessage() for r in caplog.records if job_id in r.getMessage()]
        assert lines and not [line for line in lines if "checkpoint-" in line], lines
    assert not [r for r in caplog.records if cancelled in r.getMessage() and "restart" in r.getMessage()]
