"""Retention (``trainjobs gc``): old finished jobs lose their history, everything else stays; SQLite and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from service_core.artifacts import ArtifactStore
from service_core.db import Job, JobEvent, MetricPoint
from service_core.db.base import utcnow
from service_core.db.session import make_engine
from service_core.durations import parse_duration
from service_core.retention import collect_garbage
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.api.conftest import add_job

pytestmark = pytest.mark.both_databases

REPO = Path(__file__).resolve().parents[2]
POINTS, EVENTS = 12, 5


def job_with_history(db: Session, store: ArtifactStore, status: JobStatus, finished_days_ago: float | None) -> str:
    """A job with POINTS metric points, EVENTS events and one artifact file."""
    finished = None if finished_days_ago is None else utcnow() - timedelta(days=finished_days_ago)
    job = add_job(db, "alice", status, finished_at=finished)
    db.add_all(MetricPoint(job_id=job.id, seq=i, step=i, name="loss", value=1.0 / (i + 1)) for i in range(POINTS))
    db.add_all(JobEvent(job_id=job.id, seq=i, kind="progress", data={"step": i}) for i in range(EVENTS))
    db.commit()
    Path(store.job_dir(job.id)).mkdir(parents=True)
    Path(store.job_dir(job.id), "model.safetensors").write_bytes(b"weights")
    return job.id


def counts(db: Session, job_id: str) -> tuple[int, int, int]:
    """(job rows, metric points, events) of one job."""
    db.expire_all()
    return (
        db.scalar(select(func.count()).select_from(Job).where(Job.id == job_id)) or 0,
        db.scalar(select(func.count()).select_from(MetricPoint).where(MetricPoint.job_id == job_id)) or 0,
        db.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id == job_id)) or 0,
    )


@pytest.fixture
def world(settings: Settings) -> tuple[sessionmaker[Session], ArtifactStore, dict[str, str]]:
    engine = make_engine(settings.database_url)
    maker = sessionmaker(bind=engine, expire_on_commit=False)
    store = ArtifactStore(settings.artifacts_root)
    with maker() as db:
        jobs = {
            "old_succeeded": job_with_history(db, store, JobStatus.succeeded, 100),
            "old_failed": job_with_history(db, store, JobStatus.failed, 91),
            "recent_succeeded": job_with_history(db, store, JobStatus.succeeded, 10),
            "running": job_with_history(db, store, JobStatus.running, None),
            "queued": job_with_history(db, store, JobStatus.queued, None),
        }
    return maker, store, jobs


def test_gc_deletes_old_finished_jobs_with_their_history_and_artifacts_in_batches(world: tuple) -> None:
    maker, store, jobs = world
    report = collect_garbage(maker, timedelta(days=90), artifacts=store, batch_rows=5, batch_jobs=1)
    assert (report.jobs, report.metric_points, report.events, report.artifact_dirs) == (2, 2 * POINTS, 2 * EVENTS, 2)
    # one job at a time: 12 points in batches of 5 -> 3 deletes, 5 events -> 1, plus the job row
    assert report.batches == 2 * (3 + 1 + 1)
    with maker() as db:
        for name in ("old_succeeded", "old_failed"):
            assert counts(db, jobs[name]) == (0, 0, 0), name
            assert not Path(store.job_dir(jobs[name])).exists()
        for name in ("recent_succeeded", "running", "queued"):
            assert counts(db, jobs[name]) == (1, POINTS, EVENTS), name
            assert Path(store.job_dir(jobs[name]), "model.safetensors").is_file()
    again = collect_garbage(maker, timedelta(days=90), artifacts=store)
    assert again.jobs == 0


def test_gc_batches_rows_across_jobs(world: tuple) -> None:
    maker, store, jobs = world
    report = collect_garbage(maker, timedelta(days=90), artifacts=store, batch_rows=10, batch_jobs=100)
    # both old jobs in one batch: 24 points in deletes of 10 -> 3, 10 events -> 1, the job rows -> 1
    assert (report.jobs, report.metric_points, report.events, report.batches) == (2, 2 * POINTS, 2 * EVENTS, 5)
    with maker() as db:
        assert counts(db, jobs["old_failed"]) == (0, 0, 0)
        assert counts(db, jobs["running"]) == (1, POINTS, EVENTS)


def test_keep_artifacts_keeps_the_job_rows_and_files_and_drops_only_history(world: tuple) -> None:
    maker, store, jobs = world
    report = collect_garbage(maker, timedelta(days=90), keep_artifacts=True, batch_jobs=1)
    assert (report.jobs, report.metric_points, report.events, report.artifact_dirs) == (2, 2 * POINTS, 2 * EVENTS, 0)
    with maker() as db:
        for name in ("old_succeeded", "old_failed"):
            assert counts(db, jobs[name]) == (1, 0, 0), name
            assert Path(store.job_dir(jobs[name]), "model.safetensors").is_file()
        assert counts(db, jobs["recent_succeeded"]) == (1, POINTS, EVENTS)


def gc_cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRAINJOBS_HOME": str(settings.home), "DATABASE_URL": settings.database_url,
           "ARTIFACTS_ROOT": settings.artifacts_root}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "trainjobs.cli", "gc", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_cli_dry_run_counts_then_gc_deletes(settings: Settings, world: tuple) -> None:
    maker, _, jobs = world
    dry = gc_cli(settings, "--older-than", "90d", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 2 jobs" in dry.stdout
    with maker() as db:
        assert counts(db, jobs["old_succeeded"]) == (1, POINTS, EVENTS)
    done = gc_cli(settings, "--older-than", "90d")
    assert done.returncode == 0, done.stderr
    assert f"deleted 2 jobs finished over 90d ago: {2 * POINTS} metric points, {2 * EVENTS} events" in done.stdout
    with maker() as db:
        assert counts(db, jobs["old_succeeded"]) == (0, 0, 0)
        assert counts(db, jobs["recent_succeeded"]) == (1, POINTS, EVENTS)


@pytest.mark.parametrize("text", ["90", "0d", "3w", "-1d", ""])
def test_an_unreadable_age_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="positive duration"):
        parse_duration(text)


def test_ages() -> None:
    assert parse_duration("90d") == timedelta(days=90)
    assert parse_duration("12h") == timedelta(hours=12)
    assert parse_duration(" 30m ") == timedelta(minutes=30)


def test_cli_refuses_a_bad_age_with_status_2(settings: Settings) -> None:
    result = gc_cli(settings, "--older-than", "soon")
    assert result.returncode == 2
    assert "--older-than" in result.stderr
