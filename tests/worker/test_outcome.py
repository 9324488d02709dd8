"""Every way a run can end is recorded with a reason from the one vocabulary (``ErrorReason``).

These drive :func:`worker.outcome.classify_exit` with what a real run hands the supervisor (its done
event, exit status and stderr tail); the paths through real runs are in test_supervisor.py.
"""

from __future__ import annotations

import signal
from typing import Any, get_args

import pytest

from service_core.status import ErrorReason, JobStatus
from trainer_core.events import RunStatus, make_event
from worker.outcome import RUN_END_STATUSES, RunOutcome, classify_exit


def done(status: str, **summary: Any) -> Any:
    return make_event("done", status=status, summary=summary)


def test_a_run_that_succeeded_has_no_reason() -> None:
    outcome = classify_exit(done("succeeded", train={"loss": 0.1}), 0, None, "", None)
    assert (outcome.status, outcome.reason) == (JobStatus.succeeded, None)


@pytest.mark.parametrize("stopped_by", [ErrorReason.cancelled, None])
def test_a_cancelled_run_is_cancelled_whether_or_not_we_saw_the_ask(stopped_by: ErrorReason | None) -> None:
    outcome = classify_exit(done("cancelled"), 0, stopped_by, "", None)
    assert (outcome.status, outcome.reason) == (JobStatus.cancelled, ErrorReason.cancelled)


def test_a_run_stopped_for_shutdown_is_marked_for_the_requeue() -> None:
    outcome = classify_exit(done("cancelled"), 0, ErrorReason.shutdown_requeue, "", None)
    assert (outcome.reason, outcome.stopped_by) == (ErrorReason.shutdown_requeue, ErrorReason.shutdown_requeue)
    # Killed after the grace period without a done event: the same.
    killed = classify_exit(None, -signal.SIGKILL, ErrorReason.shutdown_requeue, "", None)
    assert (killed.status, killed.reason) == (JobStatus.cancelled, ErrorReason.shutdown_requeue)


@pytest.mark.parametrize("reason", [r.value for r in ErrorReason])
def test_a_reason_the_run_names_from_the_vocabulary_is_kept(reason: str) -> None:
    outcome = classify_exit(done("failed", reason=reason, error="ValueError: bad"), 1, None, "", None)
    assert (outcome.status, outcome.reason) == (JobStatus.failed, ErrorReason(reason))


@pytest.mark.parametrize("summary", [{"reason": "error"}, {"reason": "training_error"}, {"reason": 7}, {}])
def test_any_other_reason_from_the_run_is_internal_and_keeps_its_detail(summary: dict[str, Any]) -> None:
    outcome = classify_exit(done("failed", error="KeyError: 'label'", **summary), 1, None, "", None)
    assert (outcome.status, outcome.reason) == (JobStatus.failed, ErrorReason.internal)
    assert outcome.message == "KeyError: 'label'"


def test_out_of_memory_in_the_error_text_wins_over_the_runs_reason() -> None:
    outcome = classify_exit(done("failed", reason="error", error="RuntimeError: CUDA out of memory"), 1, None, "", None)
    assert outcome.reason == ErrorReason.out_of_memory


def test_a_run_killed_by_a_signal_is_worker_lost_with_the_signal_and_the_oom_killer_hint() -> None:
    outcome = classify_exit(None, -signal.SIGKILL, None, "last words", None)
    assert (outcome.status, outcome.reason) == (JobStatus.failed, ErrorReason.worker_lost)
    assert outcome.message is not None
    assert "SIGKILL" in outcome.message and "the host may have run out of memory" in outcome.message
    assert outcome.message.endswith("last words")
    segv = classify_exit(None, -signal.SIGSEGV, None, "", None)
    assert segv.reason == ErrorReason.worker_lost and segv.message == "run killed by SIGSEGV"


def test_a_crash_without_done_event_is_internal_with_its_exit_code_and_stderr() -> None:
    outcome = classify_exit(None, 2, None, "Traceback: boom", None)
    assert (outcome.status, outcome.reason) == (JobStatus.failed, ErrorReason.internal)
    assert outcome.message == "run exited with code 2 and no done event\nTraceback: boom"


def test_every_path_gives_a_member_of_the_vocabulary() -> None:
    outcomes: list[RunOutcome] = [
        classify_exit(done("failed", reason="out_of_memory"), 1, None, "", None),
        classify_exit(done("failed", reason="nonsense"), 1, None, "", None),
        classify_exit(done("cancelled"), 0, None, "", None),
        classify_exit(None, 1, None, "MemoryError", None),
        classify_exit(None, -signal.SIGTERM, None, "", None),
        classify_exit(None, 1, None, "", None),
        classify_exit(None, 0, ErrorReason.cancelled, "", None),
    ]
    assert all(type(o.reason) is ErrorReason and type(o.status) is JobStatus for o in outcomes)


def test_the_engines_run_statuses_are_the_terminal_job_statuses() -> None:
    # RunStatus stays trainer_core's own (a Literal, or an enum): its values must be JobStatus values.
    members = getattr(RunStatus, "__members__", None)
    run_statuses = {m.value for m in members.values()} if members else set(get_args(RunStatus))
    assert run_statuses == RUN_END_STATUSES == {s.value for s in JobStatus if s.terminal}
