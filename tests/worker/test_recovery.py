"""Jobs left running by a dead worker are requeued (with a checkpoint) or failed, never left running;
jobs whose worker is alive are left alone."""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

from kombu import Connection
from sqlalchemy import update

from service_core.db import Job
from service_core.db.base import utcnow
from service_core.db.session import session_scope
from service_core.settings import Settings
from trainer_core.checkpoint import TrainProgress, checkpoint_dir, write_meta
from trainer_core.spec import parse_spec
from worker.paths import run_paths, worker_name
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
    host = worker_name()
    with_ckpt = make_job(db_settings, spec, status="running", attempts=1, worker=host, pid=dead_pid(), queue="q-rec")
    without = make_job(db_settings, spec, status="running", attempts=1, worker=host, pid=dead_pid(), queue="q-rec")
    alive = make_job(db_settings, spec, status="running", attempts=1, worker=host, pid=1)  # pid 1 is always there
    elsewhere = make_job(db_settings, spec, status="running", attempts=1, worker="other-host", pid=1)
    stale = make_job(db_settings, spec, status="running", attempts=1, worker="other-host", pid=1)
    with session_scope(db_settings.database_url) as s:
        s.execute(update(Job).where(Job.id == stale).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
    write_checkpoint(run_paths(with_ckpt, db_settings).output_dir, spec)

    results = recover_orphaned_jobs(db_settings)

    assert results == {with_ckpt: "queued", without: "failed", stale: "failed"}
    requeued = load_job(db_settings, with_ckpt)
    assert (requeued.status, requeued.attempts, requeued.worker) == ("queued", 1, None)
    lost = load_job(db_settings, without)
    assert (lost.status, lost.error_reason) == ("failed", "worker_lost")
    assert load_job(db_settings, stale).error_reason == "worker_lost"
    assert load_job(db_settings, alive).status == "running"
    assert load_job(db_settings, elsewhere).status == "running"
    assert queued_ids(db_settings, "q-rec") == [with_ckpt]  # re-enqueued to its own queue
    assert recover_orphaned_jobs(db_settings) == {}  # nothing left to recover


def test_a_leftover_run_of_a_dead_supervisor_is_killed(sqlite_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(sqlite_settings, {}, status="running", worker=worker_name(), pid=dead_pid())
    paths = run_paths(job_id, sqlite_settings)
    paths.work_dir.mkdir(parents=True)
    # Stands in for an orphaned training process: same session trick, "trainjobs" in its command line.
    orphan = subprocess.Popen(["bash", "-c", "exec -a trainjobs-run sleep 60"], start_new_session=True)
    cmdline = Path(f"/proc/{orphan.pid}/cmdline")
    for _ in range(100):  # until bash has exec'd into the renamed sleep
        if cmdline.read_bytes().startswith(b"trainjobs-run"):
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
    job_id = make_job(sqlite_settings, spec, status="running", attempts=1, worker=worker_name(), pid=dead_pid())
    write_checkpoint(run_paths(job_id, sqlite_settings).output_dir, spec)
    assert recover_orphaned_jobs(sqlite_settings) == {job_id: "queued"}  # restart 1 of 1

    # The next attempt's worker is lost too: no restart left, even with a checkpoint to resume from.
    with session_scope(sqlite_settings.database_url) as s:
        again = {"status": "running", "attempts": 2, "worker": worker_name(), "pid": dead_pid()}
        s.execute(update(Job).where(Job.id == job_id).values(**again))
    assert recover_orphaned_jobs(sqlite_settings) == {job_id: "failed"}
    job = load_job(sqlite_settings, job_id)
    assert job.error_reason == "worker_lost"
    assert "no restarts left: resources.max_restarts is 1" in (job.error_message or "")
