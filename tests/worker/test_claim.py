"""Starting a job is idempotent: a redelivered message never runs a job twice, a finished job is
never re-run, and a run's outcome never moves a status backwards or overwrites a terminal one."""

from __future__ import annotations

from sqlalchemy import func, select

from service_core.db import JobEvent
from service_core.db.jobstore import transition
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from worker.execute import claim_job, execute_job, record_outcome
from worker.outcome import RunOutcome
from worker.paths import run_paths

from .conftest import JobFactory, load_job


def event_count(settings: Settings, job_id: str) -> int:
    with session_scope(settings.database_url) as s:
        return int(s.execute(select(func.count()).where(JobEvent.job_id == job_id)).scalar_one())


def test_second_claim_of_the_same_job_loses(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    with session_scope(db_settings.database_url) as s:
        assert claim_job(s, job_id)
    with session_scope(db_settings.database_url) as s:
        assert not claim_job(s, job_id)
    job = load_job(db_settings, job_id)
    assert job.status == "running" and job.attempts == 1 and job.worker and job.pid


def test_redelivery_of_a_running_job_is_ignored(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings, status="running", attempts=1, worker="elsewhere", pid=4242)
    before = event_count(db_settings, job_id)
    assert execute_job(job_id, db_settings) is None
    job = load_job(db_settings, job_id)
    assert (job.status, job.attempts, job.worker, job.pid) == ("running", 1, "elsewhere", 4242)
    assert event_count(db_settings, job_id) == before
    assert not run_paths(job_id, db_settings).work_dir.exists()  # nothing was started


def test_finished_jobs_are_never_rerun(db_settings: Settings, make_job: JobFactory) -> None:
    for status in ("succeeded", "failed", "cancelled"):
        job_id = make_job(db_settings, status=status, attempts=1)
        assert execute_job(job_id, db_settings) is None
        job = load_job(db_settings, job_id)
        assert (job.status, job.attempts) == (status, 1)
        assert not run_paths(job_id, db_settings).work_dir.exists()


def test_an_outcome_never_overwrites_a_terminal_status(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    with session_scope(db_settings.database_url) as s:
        assert claim_job(s, job_id)
    with session_scope(db_settings.database_url) as s:  # e.g. an admin failed it meanwhile
        assert transition(s, job_id, JobStatus.failed, reason=ErrorReason.internal, expect=JobStatus.running)
    assert record_outcome(job_id, db_settings, RunOutcome(JobStatus.succeeded)) == "failed"
    job = load_job(db_settings, job_id)
    assert (job.status, job.error_reason) == ("failed", "internal")


def test_unknown_job_id_is_ignored(db_settings: Settings) -> None:
    assert execute_job("0" * 32, db_settings) is None
