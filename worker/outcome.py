"""How a run ended, in the words a job records: status, an :class:`ErrorReason` and a message.

The run's own ``done`` event is believed first; without one, the exit status and the tail of its
stderr tell: out of memory (with the job's memory estimate beside it), killed by a signal, or a crash.
Every reason is an ``ErrorReason`` member: a reason the run names that is not one becomes ``internal``.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service_core.status import ErrorReason, JobStatus, reason_or_internal
from trainer_core.events import Event

STDERR_TAIL_BYTES = 4000
# CUDA (torch.OutOfMemoryError), the CPU allocator and Python itself say it differently.
OOM_MARKERS = ("out of memory", "can't allocate memory", "cannot allocate memory", "memoryerror")
# The statuses a run's done event may report (trainer_core's RunStatus), as plain strings.
RUN_END_STATUSES = frozenset(s.value for s in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled))


@dataclass
class RunOutcome:
    """How a run ended, as the job should record it."""

    status: JobStatus  # succeeded | failed | cancelled
    reason: ErrorReason | None = None
    message: str | None = None
    exit_code: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    # Why we asked the run to stop, when we did: cancelled (a user) or shutdown_requeue (the slot stopping).
    stopped_by: ErrorReason | None = None


def stderr_tail(log_file: Path, start: int) -> str:
    """The end of what this run wrote to the log (earlier attempts' lines are left out)."""
    try:
        with log_file.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(start, size - STDERR_TAIL_BYTES))
            return handle.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def looks_out_of_memory(*texts: str | None) -> bool:
    return any(marker in (t or "").lower() for t in texts for marker in OOM_MARKERS)


def classify_exit(
    done: Event | None, returncode: int, stopped_by: ErrorReason | None, tail: str, estimate: dict[str, Any] | None
) -> RunOutcome:
    """Name the real reason a run ended: its done event, an out-of-memory, a signal or a crash."""
    summary = dict((done or {}).get("summary") or {})
    error = summary.get("error") or summary.get("message")
    error_text = str(error) if error else None
    if done is not None and done.get("status") in RUN_END_STATUSES:
        status = JobStatus(done["status"])
        if status == JobStatus.succeeded:
            return RunOutcome(status, exit_code=returncode, summary=summary, stopped_by=stopped_by)
        if status == JobStatus.cancelled:
            # A run stops itself only when asked (stop file or SIGTERM): without our ask, someone cancelled it.
            return RunOutcome(status, reason=stopped_by or ErrorReason.cancelled, exit_code=returncode,
                              summary=summary, stopped_by=stopped_by)  # fmt: skip
        if summary.get("reason") == ErrorReason.out_of_memory or looks_out_of_memory(error_text, tail):
            return RunOutcome(JobStatus.failed, ErrorReason.out_of_memory, oom_message(error_text or tail, estimate),
                              returncode, summary, stopped_by)  # fmt: skip
        # The engine's own reason when it is one of ours (invalid_spec, data_error, ...), else internal.
        reason = reason_or_internal(summary.get("reason"))
        return RunOutcome(JobStatus.failed, reason, error_text or tail or None, returncode, summary, stopped_by)
    if stopped_by is not None:
        # We asked it to stop and it did not report back (killed after the grace period).
        return RunOutcome(JobStatus.cancelled, stopped_by, f"run stopped (exit {returncode})", returncode,
                          summary, stopped_by)  # fmt: skip
    if looks_out_of_memory(tail):
        return RunOutcome(JobStatus.failed, ErrorReason.out_of_memory, oom_message(tail, estimate), returncode,
                          summary)  # fmt: skip
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = " (the host may have run out of memory)" if -returncode == signal.SIGKILL else ""
        return RunOutcome(JobStatus.failed, ErrorReason.worker_lost, f"run killed by {name}{hint}\n{tail}".strip(),
                          returncode, summary)  # fmt: skip
    return RunOutcome(JobStatus.failed, ErrorReason.internal,
                      f"run exited with code {returncode} and no done event\n{tail}".strip(), returncode,
                      summary)  # fmt: skip


def oom_message(detail: str, estimate: dict[str, Any] | None) -> str:
    """An out-of-memory message with the job's memory estimate beside it."""
    lines = [line for line in detail.splitlines() if looks_out_of_memory(line)]
    head = (lines[-1] if lines else detail.strip().splitlines()[-1] if detail.strip() else "out of memory").strip()
    total = None
    for key in ("total_bytes", "peak_bytes", "total", "peak_allocated_bytes"):
        if isinstance((estimate or {}).get(key), int | float):
            total = float((estimate or {})[key])
            break
    if total is None:
        return f"out of memory: {head} (no memory estimate recorded)"
    return f"out of memory: {head} (estimated {total / 2**30:.2f} GiB per device)"
