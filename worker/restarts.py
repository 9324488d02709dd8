"""Restart policy: infrastructure failures resume from the newest checkpoint, user errors never restart.

A run process killed by a signal we did not send (the host's OOM killer, a preemption, an eviction)
ends as ``worker_lost``; the job goes back to the queue and resumes, up to ``resources.max_restarts``
times (what Determined calls ``max_restarts`` and Ray Train ``FailureConfig``). Bad data, a bad spec
or a NaN loss would fail the same way again, so they end the job; an out-of-memory has a retry of
its own that changes the configuration. Each restart is a ``queued`` status event with the reason
and the message, so the job's history lists every attempt and why it ended.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service_core.db.models import Job, JobEvent, MetricPoint
from service_core.status import ErrorReason, JobStatus
from trainer_core.spec import ResourcesSpec

RESTARTABLE = frozenset({ErrorReason.worker_lost})
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
    return sum(
        1 for data in statuses if data.get("status") == JobStatus.queued and data.get("reason") in RESTARTABLE
    )


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
