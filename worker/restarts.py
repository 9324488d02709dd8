"""Restart policy: infrastructure failures resume from the newest checkpoint, user errors never restart.

A run process killed by a signal we did not send (the host's OOM killer, a preemption, an eviction)
ends as ``worker_lost``; the job goes back to the queue and resumes, up to ``resources.max_restarts``
times (what Determined calls ``max_restarts`` and Ray Train ``FailureConfig``). Bad data, a bad spec
or a NaN loss would fail the same way again, so they end the job; an out-of-memory has a retry of
its own that changes the configuration. Each restart is a ``queued`` status event with the reason
and the message, so the job's history lists every attempt and why it ended. Whoever requeued the job,
:func:`prepare_resume` makes its next attempt's starting point agree with the database, fetching the
checkpoint from the object store on a remote artifacts root.
"""

from __future__ import annotations

import logging
import shutil
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service_core.db.models import Job, JobEvent, MetricPoint
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.checkpoint import complete_checkpoints, newest_checkpoint, read_progress
from trainer_core.spec import ResourcesSpec
from worker.checkpoint_sync import fetch_newest
from worker.paths import RunPaths

log = logging.getLogger(__name__)

RESTARTABLE = frozenset({ErrorReason.worker_lost})
# The message of a requeue (or failure) by the sweep (worker/recovery.py): the supervisor itself was
# lost, and with it any events it had not written yet (prepare_resume reads it).
LOST_WORKER_MESSAGE = "the worker running this job was lost"
DEFAULT_MAX_RESTARTS: int = ResourcesSpec.model_fields["max_restarts"].default


def max_restarts(spec: dict[str, Any]) -> int:
    """The job's restart budget (specs stored before the field existed get the default)."""
    value = (spec.get("resources") or {}).get("max_restarts", DEFAULT_MAX_RESTARTS)
    return int(value)


def restarts_used(session: Session, job_id: str) -> int:
    """How often the job already went back to the queue after an infrastructure failure."""
    statuses = session.execute(
        select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "status")
    ).scalars()
    return sum(1 for data in statuses if data.get("status") == JobStatus.queued and data.get("reason") in RESTARTABLE)


def rewind_metrics(session: Session, job_id: str, checkpoint_step: int, attempt: int | None = None) -> int:
    """Drop the metric points an abandoned attempt logged after ``checkpoint_step``; how many.

    The resumed run trains those steps again and logs them anew, so without this a step would have
    two points (the curve would double back). The attempt's events stay in the history. ``attempt``
    fences it like every worker write: nothing is dropped once another attempt owns the job.
    """
    condition = [MetricPoint.job_id == job_id, MetricPoint.step > checkpoint_step]
    if attempt is not None:
        owned = select(Job.id).where(Job.id == job_id, Job.attempts == attempt, Job.status == JobStatus.running)
        condition.append(owned.exists())
    result = session.execute(delete(MetricPoint).where(*condition))
    return int(getattr(result, "rowcount", 0) or 0)


def prepare_resume(job_id: str, settings: Settings, paths: RunPaths, attempt: int | None = None) -> bool:
    """Whether the run resumes from a checkpoint, made consistent with what the database holds.

    Whoever requeued the job (a restart, a worker's shutdown, the recovery of a killed slot), its last
    attempt may have got ahead of the database: a killed slot loses the events it had not yet written,
    while its run saved checkpoints on. A checkpoint past the job's stored progress is deleted (its
    steps would have no points), and the points after the checkpoint resumed from are dropped (the
    resumed run logs them anew): one point per step either way. When the supervisor itself was lost
    (the sweep requeued the job), even a checkpoint at the stored step is not trusted: the events of
    that step after its progress event (its loss, its evaluation) may have died in the supervisor's
    buffer. A supervisor that lived flushed everything before it requeued, so its checkpoints are.
    Without any checkpoint the run starts over, and every point an earlier attempt logged goes.
    On a remote artifacts root the store's checkpoints count too: the newest trusted one is fetched
    when this disk has none as new, and those past the trusted step are deleted there as well.
    """
    with session_scope(settings.database_url) as session:
        stored = session.execute(select(Job.progress_step).where(Job.id == job_id)).scalar_one()
        trusted = stored - 1 if supervisor_was_lost(session, job_id) else stored
    for ahead in complete_checkpoints(paths.output_dir):
        if read_progress(ahead).global_step > trusted:
            log.info("job %s: %s is past the stored step %d: not resuming from it", job_id, ahead.name, stored)
            shutil.rmtree(ahead, ignore_errors=True)
    fetch_newest(settings, job_id, paths.output_dir, trusted)  # another host's, or this one's lost disk
    checkpoint = newest_checkpoint(paths.output_dir)
    step = read_progress(checkpoint).global_step if checkpoint is not None else 0
    with session_scope(settings.database_url) as session:
        dropped = rewind_metrics(session, job_id, step, attempt)
    if dropped:
        log.info("job %s: dropped %d metric points after step %d, logged anew on resume", job_id, dropped, step)
    return checkpoint is not None


def supervisor_was_lost(session: Session, job_id: str) -> bool:
    """Whether the sweep requeued the job after its last attempt's supervisor was lost.

    Read back from the newest status event, past this attempt's own ``running`` (its claim wrote it
    before the resume is prepared), to the previous attempt's ``running``: the requeue lies between.
    """
    statuses = session.execute(
        select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "status")
        .order_by(JobEvent.seq.desc()).limit(50)
    ).scalars()  # fmt: skip
    for index, data in enumerate(statuses):
        if data.get("status") == JobStatus.running:
            if index == 0:
                continue
            return False
        if str(data.get("message") or "").startswith(LOST_WORKER_MESSAGE):
            return True
    return False
