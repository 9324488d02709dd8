"""The one job vocabulary: statuses, the moves allowed between them, why a job ended, and the CLI exit
code of each end state. Standard library only, so the lean client, the CLI, the API schemas, the
worker and the dashboard (through the OpenAPI enums) all read this file and
keep no copy of their own.
"""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    """Where a job is. Status moves only forward; terminal statuses are final."""

    queued = "queued"
    running = "running"
    paused = "paused"  # a person paused it: it holds a checkpoint and waits for a resume, off the queue
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
# Allowed moves; running -> queued is the one step back, for a job requeued to resume elsewhere, and
# paused -> queued is a resume.
ALLOWED_TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    JobStatus.queued: frozenset({JobStatus.running, JobStatus.cancelled, JobStatus.failed, JobStatus.paused}),
    JobStatus.running: frozenset(
        {JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled, JobStatus.queued, JobStatus.paused}
    ),
    JobStatus.paused: frozenset({JobStatus.queued, JobStatus.cancelled}),
    JobStatus.succeeded: frozenset(),
    JobStatus.failed: frozenset(),
    JobStatus.cancelled: frozenset(),
}


def can_transition(current: JobStatus, new: JobStatus) -> bool:
    return new in ALLOWED_TRANSITIONS[current]


class ErrorReason(enum.StrEnum):
    """Why a job ended other than by succeeding (or why it went back to the queue).

    The README's "Failure reasons" table documents each one; a test keeps the two in step.
    """

    invalid_spec = "invalid_spec"  # the spec cannot run as written
    data_error = "data_error"  # data missing, unreadable, or without the columns/labels it needs
    model_error = "model_error"  # model could not load: missing files, wrong head, missing weights
    out_of_memory = "out_of_memory"  # the device (or host) ran out of memory: retried smaller, then failed
    nan_loss = "nan_loss"  # the logged loss stopped being finite (trainer_core/nan_guard.py)
    cancelled = "cancelled"  # a person cancelled it, queued or running
    shutdown_requeue = "shutdown_requeue"  # its slot shut down (its worker stopping); it went back to the queue
    paused = "paused"  # a person paused it: its run checkpointed and stopped (the reason on the status event)
    worker_lost = "worker_lost"  # its slot, host or run process was lost: requeued while restarts last, else failed
    timeout = "timeout"  # it ran past resources.max_runtime_minutes
    internal = "internal"  # anything else: a bug or an unexpected crash (the log has the traceback)


_REASON_VALUES = frozenset(r.value for r in ErrorReason)


def reason_or_internal(value: str | None) -> ErrorReason:
    """``value`` as an :class:`ErrorReason`; anything else is ``internal``.

    For reasons that come from outside this code: a run's own summary, or a row written before the
    vocabulary (e.g. ``cancel``), which must still be shown rather than fail the answer.
    """
    if isinstance(value, str) and value in _REASON_VALUES:  # a run's JSON may hold anything
        return ErrorReason(value)
    return ErrorReason.internal


# The exit code of every command that waits for a job (`submit --follow`, `jobs logs --follow`,
# `train`): 0 only for success, so scripts can chain on it.
EXIT_CODES: dict[JobStatus, int] = {JobStatus.succeeded: 0, JobStatus.failed: 1, JobStatus.cancelled: 3}
# A request the service refused (bad spec, over budget): nothing ran.
EXIT_REFUSED = 2


def exit_code(status: str) -> int:
    """The exit code for a job that ended in ``status`` (failed for anything unexpected)."""
    try:
        return EXIT_CODES.get(JobStatus(status), EXIT_CODES[JobStatus.failed])
    except ValueError:
        return EXIT_CODES[JobStatus.failed]
