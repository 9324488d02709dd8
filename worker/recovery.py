"""Jobs whose slot or host was lost: never left ``running`` forever.

Run by the sweep (worker/sweeper.py), every ``TRAINJOBS_SWEEP_SECONDS`` in every worker and once when a
worker (or ``trainjobs dev``) starts. A ``running`` job is orphaned when its heartbeat lease
(``lease_expires_at``, renewed by its slot, worker/lease.py) has run out, wherever it ran, or when it
belongs to this host and the slot process that claimed it (``Job.pid``) is gone. A lost slot is an
infrastructure failure: while the job has restarts left (``resources.max_restarts``) it goes back to
the queue (its attempts are kept; the next claim adds one, fencing the lost slot out) and resumes
from its newest complete checkpoint, in the object store on a remote artifacts root (the lost host's
disk may be gone), or from step 0 when it has none. With its restarts spent, or a cancel requested,
it fails with reason ``worker_lost``. Both moves carry the attempt the sweep saw and an expired lease
as conditions, so a slot that renewed meanwhile keeps its job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import ColumnElement, or_, select

from service_core.db.base import as_utc, utcnow
from service_core.db.jobstore import transition
from service_core.db.models import Job
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from worker.checkpoint_sync import resume_phrase
from worker.paths import host_name, run_paths
from worker.procfs import cmdline
from worker.restarts import LOST_WORKER_MESSAGE, max_restarts, restarts_used

log = logging.getLogger(__name__)


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
    if b"trainjobs" in cmdline(pid):  # the pid was not reused by something else
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    pid_file.unlink(missing_ok=True)


def lease_expiry(job: Job, lease_s: float) -> datetime:
    """When ``job``'s lease runs out (a row without one, claimed before leases existed: its last update
    plus a lease)."""
    expiry = job.lease_expires_at or job.updated_at + timedelta(seconds=lease_s)
    return as_utc(expiry)


def is_orphaned(job: Job, host: str, now: datetime, lease_s: float) -> bool:
    """Whether nobody is running ``job`` any more (see the module docstring)."""
    if lease_expiry(job, lease_s) < now:
        return True
    return job.worker == host and not pid_alive(job.pid)


def requeue_or_fail(
    job_id: str,
    settings: Settings,
    *,
    may_requeue: bool,
    message: str,
    resume: str = "",
    requeue_reason: ErrorReason | None = None,
    attempt: int | None = None,
    conditions: Sequence[ColumnElement[bool]] = (),
) -> str:
    """``running -> queued`` (and enqueue) when ``may_requeue`` (restarts left, or a stop that spends none)
    and no cancel is requested, else ``running -> failed/worker_lost``.

    ``message`` says why; ``resume`` says where the next attempt starts (:func:`resume_phrase`, from
    what is really there) and goes after it only when the job does go back to the queue, so a failure
    never claims a restart. ``requeue_reason`` (with the message) goes on the requeue's status event,
    when the cause is known.
    ``attempt`` fences the move (only while that attempt still runs); ``conditions`` narrow it further.
    """
    from service_core.queue import enqueue_job

    requeue_message = "; ".join(part for part in (message, resume) if part)
    with session_scope(settings.database_url) as session:
        queue, priority, cancel_requested = session.execute(
            select(Job.queue, Job.priority, Job.cancel_requested).where(Job.id == job_id)
        ).one()
        if may_requeue and not cancel_requested:
            moved = transition(session, job_id, JobStatus.queued, expect=JobStatus.running, worker=None, pid=None,
                               reason=requeue_reason, message=requeue_message if requeue_reason else None,
                               attempt=attempt, conditions=conditions, enqueued_at=utcnow())  # fmt: skip
            new = JobStatus.queued
        else:
            moved = transition(session, job_id, JobStatus.failed, expect=JobStatus.running,
                               reason=ErrorReason.worker_lost, message=message, pid=None,
                               attempt=attempt, conditions=conditions)  # fmt: skip
            new = JobStatus.failed
    if moved and new == JobStatus.queued:
        # A crash before this send leaves the job queued and stamped: the sweep re-sends it.
        enqueue_job(job_id, queue, priority, settings)
        log.info("job %s requeued: %s", job_id, requeue_message)
    elif moved:
        log.warning("job %s failed (worker_lost): %s%s", job_id, message,
                    " (a cancel was requested)" if cancel_requested else "")  # fmt: skip
    return new.value if moved else "unchanged"


def recover_orphaned_jobs(settings: Settings, *, host: str | None = None) -> dict[str, str]:
    """Requeue or fail every orphaned running job; returns ``{job_id: new status}``."""
    host = host or host_name()
    now = utcnow()
    with session_scope(settings.database_url) as session:
        # Only candidates leave the database: a lease past (or none) anywhere, any job of this host.
        candidate = or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < now, Job.worker == host)
        running = session.execute(select(Job).where(Job.status == JobStatus.running.value, candidate)).scalars().all()
        orphans = [(job.id, job.attempts, job.worker, max_restarts(job.spec)) for job in running
                   if is_orphaned(job, host, now, settings.lease_seconds)]  # fmt: skip
        used = {job_id: restarts_used(session, job_id) for job_id, *_ in orphans}
    results: dict[str, str] = {}
    for job_id, attempt, ran_on, budget in orphans:
        paths = run_paths(job_id, settings)
        if ran_on == host:  # a run pid file names a process of this machine only
            kill_leftover_run(paths.pid_file)
        # A lost slot is an infrastructure failure: it spends one of the job's restarts.
        spent = used[job_id] >= budget
        resume = ""
        if spent:
            message = f"{LOST_WORKER_MESSAGE} (no restarts left: resources.max_restarts is {budget})"
        else:
            message = LOST_WORKER_MESSAGE
            start = resume_phrase(settings, job_id, paths.output_dir)
            resume = f"it runs again {start}, restart {used[job_id] + 1} of {budget}"
        # Still expired at the UPDATE: a slot that renewed since we looked keeps its job.
        still_lost = (or_(Job.lease_expires_at.is_(None), Job.lease_expires_at < now, Job.worker == host),)
        results[job_id] = requeue_or_fail(
            job_id, settings, may_requeue=not spent, message=message, resume=resume,
            requeue_reason=ErrorReason.worker_lost, attempt=attempt, conditions=still_lost,
        )  # fmt: skip
    return results
