"""Jobs whose worker died: never left ``running`` forever.

Run when a worker starts (and when ``trainjobs dev`` starts). A ``running`` job is orphaned when it
belongs to this host and the worker process that claimed it (``Job.pid``) is gone, or when its
heartbeat (``updated_at``, refreshed by the supervisor every few seconds) is older than
``stale_after_s`` wherever it ran. An orphan with a checkpoint goes back to the queue and resumes
from it (its attempts are kept); one without fails with reason ``worker_lost``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from datetime import timedelta
from pathlib import Path

from sqlalchemy import select

from service_core.db.base import utcnow
from service_core.db.jobstore import transition
from service_core.db.models import Job
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.checkpoint import newest_checkpoint
from worker.paths import run_paths, worker_name

log = logging.getLogger(__name__)

STALE_AFTER_S = 120.0


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_leftover_run(pid_file: Path) -> None:
    """A run whose supervisor died keeps running in its own session: end its process group."""
    try:
        pid = int(pid_file.read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        cmdline = b""
    if b"trainjobs" in cmdline:  # the pid was not reused by something else
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)


def is_orphaned(job: Job, host: str, stale_after_s: float) -> bool:
    """Whether nobody is running ``job`` any more (see the module docstring)."""
    heartbeat = job.updated_at if job.updated_at.tzinfo else job.updated_at.replace(tzinfo=utcnow().tzinfo)
    stale = utcnow() - heartbeat > timedelta(seconds=stale_after_s)
    if job.worker == host:
        return stale or not pid_alive(job.pid)
    return stale


def requeue_or_fail(
    job_id: str, settings: Settings, *, has_checkpoint: bool, message: str, requeue_reason: ErrorReason | None = None
) -> str:
    """``running -> queued`` (and enqueue) with a checkpoint, else ``running -> failed/worker_lost``.

    ``requeue_reason`` (with ``message``) goes on the requeue's status event, when the cause is known.
    """
    from service_core.queue import enqueue_job

    with session_scope(settings.database_url) as session:
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        queue, priority = job.queue, job.priority
        if has_checkpoint and not job.cancel_requested:
            moved = transition(session, job_id, JobStatus.queued, expect=JobStatus.running, worker=None, pid=None,
                               reason=requeue_reason, message=message if requeue_reason else None)  # fmt: skip
            new = JobStatus.queued
        else:
            moved = transition(session, job_id, JobStatus.failed, expect=JobStatus.running,
                               reason=ErrorReason.worker_lost, message=message, pid=None)  # fmt: skip
            new = JobStatus.failed
    if moved and new == JobStatus.queued:
        enqueue_job(job_id, queue, priority, settings)
        log.info("job %s requeued to resume from its checkpoint", job_id)
    elif moved:
        log.warning("job %s failed: %s (no checkpoint to resume from)", job_id, message)
    return new.value if moved else "unchanged"


def recover_orphaned_jobs(
    settings: Settings, *, host: str | None = None, stale_after_s: float = STALE_AFTER_S
) -> dict[str, str]:
    """Requeue or fail every orphaned running job; returns ``{job_id: new status}``."""
    host = host or worker_name()
    with session_scope(settings.database_url) as session:
        running = session.execute(select(Job).where(Job.status == JobStatus.running.value)).scalars().all()
        orphans = [job.id for job in running if is_orphaned(job, host, stale_after_s)]
    results: dict[str, str] = {}
    for job_id in orphans:
        paths = run_paths(job_id, settings)
        kill_leftover_run(paths.pid_file)
        has_checkpoint = newest_checkpoint(paths.output_dir) is not None
        results[job_id] = requeue_or_fail(
            job_id, settings, has_checkpoint=has_checkpoint, message="the worker running this job was lost"
        )
    return results
