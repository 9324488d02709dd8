"""After a device out-of-memory: retry with the next smaller configuration instead of failing the job.

The attempt that ran out is recorded as a ``retry`` event (its step, micro-batch, accumulation, the
estimate and the measured peak when known, and the changes for the next attempt), which SSE and
polling show like any other event. The job's stored spec takes the changes (the planner's ladder,
:func:`trainer_core.memory.planner.next_oom_changes`) and the job goes back to the queue
(``running -> queued``); the next run resumes from the newest checkpoint when there is one. After
``resources.max_oom_retries`` retries, or when no smaller configuration is left, the job fails with
reason ``out_of_memory`` and the retries it made in its message.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from sqlalchemy import func, select

from service_core.db.base import utcnow
from service_core.db.jobstore import add_events, transition
from service_core.db.models import Job, JobEvent
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.spec import JobSpec, SpecError
from worker.outcome import RunOutcome

log = logging.getLogger(__name__)
RETRY_KIND = "retry"


def _peak(measured: dict[str, Any] | None) -> Any:
    return (measured or {}).get("peak_allocated_bytes")


def _exhausted(done: int, changes: dict[str, Any] | None) -> str:
    tried = f"after {done} out-of-memory retr{'y' if done == 1 else 'ies'}"
    if changes is None:
        return f"{tried}; no smaller configuration with the same effective batch is left"
    shown = ", ".join(f"{k}={v}" for k, v in changes.items())
    return f"{tried}; the next configuration would be {shown} (raise resources.max_oom_retries to try it)"


def retry_after_oom(
    job_id: str, settings: Settings, outcome: RunOutcome, attempt: int | None = None
) -> RunOutcome | None:
    """Requeue ``job_id`` with a smaller configuration; None when it did so, else the outcome to record
    (the same one, with the retries made named in its message). ``attempt`` fences every write."""
    from service_core.queue import enqueue_job

    # Here, not at the top: trainer_core.memory needs the [train] extra (accelerate, torch), and a
    # worker's main process imports this module when it starts, [server] install or not.
    from trainer_core.memory.planner import apply_changes, next_oom_changes

    fence = attempt
    with session_scope(settings.database_url) as session:
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        done = session.execute(
            select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == RETRY_KIND)
        ).scalar_one()
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValueError:
            return outcome
        changes = next_oom_changes(spec)
        if job.cancel_requested or done >= spec.resources.max_oom_retries or changes is None:
            return replace(outcome, message=f"{outcome.message} ({_exhausted(done, changes)})")
        try:
            new_spec = apply_changes(spec, changes)
        except SpecError:
            return outcome
        record = {
            "reason": ErrorReason.out_of_memory.value,
            "attempt": done + 1,
            "step": job.progress_step,
            "micro_batch": spec.training.per_device_train_batch_size,
            "gradient_accumulation_steps": spec.efficiency.gradient_accumulation_steps,
            "estimate_total_bytes": (job.estimate or {}).get("total_bytes"),
            "measured_peak_bytes": _peak(job.measured_memory),
            "message": outcome.message,
            "changes": changes,
        }
        stored = new_spec.model_dump(mode="json", exclude_unset=True)
        # The move first: a stale attempt (fenced out) changes neither the spec nor the history.
        moved = transition(session, job_id, JobStatus.queued, expect=JobStatus.running, attempt=fence,
                           reason=ErrorReason.out_of_memory, message=outcome.message, worker=None, pid=None,
                           enqueued_at=utcnow(), spec=stored)  # fmt: skip
        if not moved:
            return outcome
        add_events(session, job_id, [(RETRY_KIND, record, None)])
        queue, priority = job.queue, job.priority
    enqueue_job(job_id, queue, priority, settings)
    log.info("job %s: out of memory, requeued with %s (retry %d)", job_id, changes, done + 1)
    return None
