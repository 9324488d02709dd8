"""Retention: delete old finished jobs' metric points and events (and the jobs and their artifacts).

``trainjobs gc --older-than 90d`` calls :func:`collect_garbage`. It works in small batches, each its own
short transaction, so the API and workers writing other jobs never wait behind one long delete: a
batch removes at most ``batch_rows`` rows by primary key (found through the ``job_id``-leading
indexes), commits, and moves on. Only jobs in a terminal status whose ``finished_at`` is older than the
cutoff are touched (``ix_jobs_finished``); a running or queued job is never collected, whatever its age.

The running totals of finished jobs (``job_totals``, behind ``/metrics``' counters) are not touched:
a collected job stays counted, so no Prometheus counter goes back.

With ``keep_artifacts`` the job rows and their artifacts stay (so a trained model can still be
downloaded, with the job's final metrics); only the bulky history (points and events) goes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from service_core.artifacts import ArtifactStore
from service_core.db.base import utcnow
from service_core.db.models import Job, JobEvent, MetricPoint
from service_core.status import TERMINAL_STATUSES

logger = logging.getLogger(__name__)

TERMINAL = sorted(s.value for s in TERMINAL_STATUSES)
@dataclass
class GcReport:
    """What one collection removed (or, with ``dry_run``, would remove: jobs only)."""

    jobs: int = 0
    metric_points: int = 0
    events: int = 0
    artifact_dirs: int = 0
    batches: int = 0


def old_job_ids(session: Session, cutoff: datetime, limit: int, after: str | None = None) -> list[str]:
    """Up to ``limit`` ids of terminal jobs finished before ``cutoff``, oldest first (keyset on id)."""
    query = select(Job.id).where(Job.status.in_(TERMINAL), Job.finished_at < cutoff)
    if after is not None:
        query = query.where(Job.id > after)
    return list(session.execute(query.order_by(Job.id).limit(limit)).scalars())


def _delete_rows(maker: sessionmaker[Session], model: type[MetricPoint] | type[JobEvent], job_ids: list[str],
                 batch_rows: int) -> tuple[int, int]:  # fmt: skip
    """All rows of ``model`` of these jobs, ``batch_rows`` per transaction; (rows, batches)."""
    total = batches = 0
    while True:
        with maker() as session, session.begin():
            query = select(model.id).where(model.job_id.in_(job_ids)).limit(batch_rows)
            ids = list(session.execute(query).scalars())
            if ids:
                session.execute(delete(model).where(model.id.in_(ids)))
        if not ids:
            return total, batches
        total += len(ids)
        batches += 1


def collect_garbage(
    maker: sessionmaker[Session],
    older_than: timedelta,
    *,
    keep_artifacts: bool = False,
    artifacts: ArtifactStore | None = None,
    batch_rows: int = 5000,
    batch_jobs: int = 100,
    dry_run: bool = False,
    now: datetime | None = None,
) -> GcReport:
    """Remove the history of terminal jobs that finished more than ``older_than`` ago (see the module doc).

    ``artifacts`` is required unless ``keep_artifacts``: each collected job's artifact folder is removed
    before its row, so a crash in between leaves a row without files, never files without a row.
    """
    if not keep_artifacts and artifacts is None and not dry_run:
        raise ValueError("artifacts store needed to delete artifacts (or pass keep_artifacts=True)")
    cutoff = (now or utcnow()) - older_than
    report = GcReport()
    after: str | None = None
    while True:
        with maker() as session:
            ids = old_job_ids(session, cutoff, batch_jobs, after)
        if not ids:
            return report
        after = ids[-1]  # with keep_artifacts the rows stay: keyset past them instead of re-reading them
        report.jobs += len(ids)
        if dry_run:
            continue
        for model, field in ((MetricPoint, "metric_points"), (JobEvent, "events")):
            rows, batches = _delete_rows(maker, model, ids, batch_rows)
            setattr(report, field, getattr(report, field) + rows)
            report.batches += batches
        if not keep_artifacts:
            assert artifacts is not None
            for job_id in ids:
                job_dir = artifacts.job_dir(job_id)
                if artifacts.fs.exists(job_dir):
                    artifacts.fs.rm(job_dir, recursive=True)
                    report.artifact_dirs += 1
            with maker() as session, session.begin():
                # Terminal statuses are final, so the filter only guards against a hand-edited row.
                session.execute(delete(Job).where(Job.id.in_(ids), Job.status.in_(TERMINAL), Job.finished_at < cutoff))
            report.batches += 1
        logger.info("gc: %d jobs so far (%d points, %d events)", report.jobs, report.metric_points, report.events)
