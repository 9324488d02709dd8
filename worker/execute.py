"""What a worker does with one job id: claim it, run it, record how it ended, store its artifacts.

Plain functions (the Celery task only calls :func:`execute_job`), so tests and the dev launcher run
them without a broker. The claim is a compare-and-set ``queued -> running``: a redelivered message
for a job that is running elsewhere or already finished changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service_core.artifacts import ArtifactStore
from service_core.db.jobstore import transition
from service_core.db.models import Job, JobStatus
from service_core.db.session import session_scope
from service_core.settings import Settings
from trainer_core.checkpoint import CHECKPOINT_PREFIX, newest_checkpoint
from worker.oom_retry import retry_after_oom
from worker.outcome import RunOutcome
from worker.supervisor import RunPaths, supervise_run

log = logging.getLogger(__name__)


def worker_name() -> str:
    """How a job records which machine runs it (recovery compares it with its own host)."""
    return socket.gethostname()


def session_factory(settings: Settings) -> Callable[[], Any]:
    @contextmanager
    def factory() -> Iterator[Session]:
        with session_scope(settings.database_url) as session:
            yield session

    return factory


def is_local_root(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def run_paths(job_id: str, settings: Settings) -> RunPaths:
    """A local artifacts root is trained into directly; otherwise a working dir is uploaded at the end."""
    work_dir = (settings.home / "runs" / job_id).resolve()
    root = settings.artifacts_root
    if is_local_root(root):
        output_dir = Path(root.removeprefix("file://")).resolve() / job_id
    else:
        output_dir = work_dir / "output"
    return RunPaths(work_dir=work_dir, output_dir=output_dir, cache_dir=(settings.home / "cache").resolve())


def claim_job(session: Session, job_id: str) -> bool:
    """Move a queued job to running for this worker process; False if it is not queued any more."""
    return transition(
        session, job_id, JobStatus.running, expect=JobStatus.queued,
        attempts=Job.attempts + 1, worker=worker_name(), pid=os.getpid(),
    )  # fmt: skip


def final_metrics(summary: dict[str, Any], latest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's final numbers: its train summary and final evaluation, flat."""
    out: dict[str, Any] = {}
    for part in ("train", "eval"):
        values = summary.get(part)
        if isinstance(values, dict):
            out.update({k: v for k, v in values.items() if isinstance(v, int | float) or v is None})
    if not out and latest:
        out = {k: v for k, v in latest.items() if k.startswith("eval_")}
    return out or None


def execute_job(job_id: str, settings: Settings, *, should_stop: Callable[[], bool] = lambda: False) -> str | None:
    """Claim and run one job to its end; returns the status it ended in, or None when not claimed.

    ``should_stop`` is the worker shutting down: the run checkpoints and the job goes back to the
    queue (``running -> queued``) to resume on the next worker, instead of being cancelled.
    """
    with session_scope(settings.database_url) as session:
        if not claim_job(session, job_id):
            status = session.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()
            log.info("job %s not claimed (status %s): ignoring this delivery", job_id, status)
            return None
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        spec, estimate = dict(job.spec), job.estimate
    paths = run_paths(job_id, settings)
    paths.work_dir.mkdir(parents=True, exist_ok=True)
    paths.spec_file.write_text(json.dumps(spec, indent=2), encoding="utf-8")
    resume = newest_checkpoint(paths.output_dir) is not None
    log.info("job %s: running in %s (resume=%s)", job_id, paths.output_dir, resume)
    try:
        outcome = supervise_run(
            job_id, paths, session_factory(settings), resume=resume, grace_s=settings.cancel_grace_seconds,
            should_stop=should_stop, estimate=estimate,
        )  # fmt: skip
    except Exception as exc:
        log.exception("job %s: supervising the run failed", job_id)
        outcome = RunOutcome("failed", "worker_error", f"{type(exc).__name__}: {exc}")
    if outcome.stopped_by == "shutdown":
        return requeue_after_shutdown(job_id, settings, paths, outcome)
    if outcome.reason == "out_of_memory":
        retried = retry_after_oom(job_id, settings, outcome)
        if retried is None:
            return JobStatus.queued.value
        outcome = retried
    store_artifacts(job_id, settings, paths)
    return record_outcome(job_id, settings, outcome)


def record_outcome(job_id: str, settings: Settings, outcome: RunOutcome) -> str:
    """Write the terminal status; a status some other writer already made terminal is left alone."""
    with session_scope(settings.database_url) as session:
        latest = session.execute(select(Job.latest_metrics).where(Job.id == job_id)).scalar_one_or_none()
        new = JobStatus(outcome.status)
        reason = outcome.reason if new != JobStatus.succeeded else None
        moved = transition(
            session, job_id, new, expect=JobStatus.running, reason=reason, message=outcome.message,
            final_metrics=final_metrics(outcome.summary, latest), pid=None,
        )  # fmt: skip
        current = session.execute(select(Job.status).where(Job.id == job_id)).scalar_one()
    if not moved:
        log.warning("job %s: run ended %s but the job is already %s", job_id, outcome.status, current)
    log.info("job %s: %s%s", job_id, current, f" ({outcome.reason})" if outcome.reason else "")
    return str(current)


def requeue_after_shutdown(job_id: str, settings: Settings, paths: RunPaths, outcome: RunOutcome) -> str:
    """The worker is stopping: put the job back to resume from its checkpoint, or fail it if it has none."""
    from worker.recovery import requeue_or_fail

    status = requeue_or_fail(job_id, settings, has_checkpoint=newest_checkpoint(paths.output_dir) is not None,
                             message="the worker shut down while the job ran")  # fmt: skip
    if status != JobStatus.queued.value:
        store_artifacts(job_id, settings, paths)
    return status


def store_artifacts(job_id: str, settings: Settings, paths: RunPaths) -> None:
    """Upload the run's outputs (checkpoints stay behind) and its log; failures are logged, not fatal."""
    store = ArtifactStore(settings.artifacts_root)
    try:
        if paths.output_dir.is_dir():
            store.upload_dir(job_id, paths.output_dir, skip=(CHECKPOINT_PREFIX,))
        if paths.log_file.is_file():
            target = f"{store.job_dir(job_id)}/worker.log"
            store.fs.makedirs(store.job_dir(job_id), exist_ok=True)
            store.fs.put_file(str(paths.log_file), target)
    except OSError:
        log.exception("job %s: storing artifacts failed", job_id)
