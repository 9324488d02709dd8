"""Every write a worker makes for a job carries its attempt number: once the job was requeued and
claimed again, the old attempt's status moves, events, metric points, progress, lease renewals and
requeues are refused, and the new attempt's go through."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from service_core.db import Job, JobEvent, MetricPoint
from service_core.db.base import utcnow
from service_core.db.jobstore import FencedOut, renew_lease
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.status import JobStatus
from trainer_core.events import make_event
from worker.execute import claim_job, record_outcome, session_factory
from worker.ingest import EventIngestor
from worker.lease import LeaseKeeper
from worker.outcome import RunOutcome
from worker.recovery import recover_orphaned_jobs, requeue_or_fail

from .conftest import JobFactory, load_job


def rows(settings: Settings, job_id: str) -> tuple[int, int]:
    """(event rows, metric point rows) of the job."""
    with session_scope(settings.database_url) as s:
        events = s.execute(select(func.count()).where(JobEvent.job_id == job_id)).scalar_one()
        points = s.execute(select(func.count()).where(MetricPoint.job_id == job_id)).scalar_one()
    return int(events), int(points)


def expire_lease(settings: Settings, job_id: str) -> None:
    with session_scope(settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(lease_expires_at=utcnow() - timedelta(seconds=1)))


def claim(settings: Settings, job_id: str) -> int:
    with session_scope(settings.database_url) as s:
        attempt = claim_job(s, job_id, settings.lease_seconds)
    assert attempt is not None
    return attempt


def test_the_claim_hands_out_the_attempt_and_a_lease(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    before = utcnow()
    assert claim(db_settings, job_id) == 1
    expires = load_job(db_settings, job_id).lease_expires_at
    assert expires is not None
    expires = expires if expires.tzinfo else expires.replace(tzinfo=before.tzinfo)
    assert before + timedelta(seconds=db_settings.lease_seconds - 5) < expires
    with session_scope(db_settings.database_url) as s:
        assert renew_lease(s, job_id, 1, db_settings.lease_seconds)
        assert not renew_lease(s, job_id, 2, db_settings.lease_seconds)  # no such attempt


def test_a_stale_attempt_writes_nothing_over_the_new_one(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings, {}, queue="q-fence")
    old = claim(db_settings, job_id)
    stale = EventIngestor(job_id, session_factory(db_settings), attempt=old, progress_rows_per_s=0)
    stale.add(make_event("progress", step=3, total_steps=10))
    stale.flush()
    # The old slot froze: its lease ran out, the sweep requeued the job, another slot claimed it.
    expire_lease(db_settings, job_id)
    assert requeue_or_fail(job_id, db_settings, may_requeue=True, message="lost", attempt=old) == "queued"
    new = claim(db_settings, job_id)
    assert new == old + 1
    fresh = EventIngestor(job_id, session_factory(db_settings), attempt=new, progress_rows_per_s=0)
    fresh.add(make_event("progress", step=4, total_steps=10))
    fresh.flush()
    before = rows(db_settings, job_id)

    # The old slot wakes up: progress, metrics, its outcome, its lease and a requeue are all refused.
    stale.add(make_event("progress", step=9, total_steps=10))
    stale.add(make_event("metric", step=9, values={"loss": 0.5}))
    with pytest.raises(FencedOut):
        stale.flush()
    assert record_outcome(job_id, db_settings, RunOutcome(JobStatus.succeeded), attempt=old) == "running"
    with session_scope(db_settings.database_url) as s:
        assert not renew_lease(s, job_id, old, db_settings.lease_seconds)
    assert requeue_or_fail(job_id, db_settings, may_requeue=True, message="stale", attempt=old) == "unchanged"
    job = load_job(db_settings, job_id)
    assert (job.status, job.attempts, job.progress_step) == ("running", new, 4)
    assert rows(db_settings, job_id) == before

    # The current attempt still writes, and ends the job.
    fresh.add(make_event("metric", step=5, values={"loss": 0.4}))
    fresh.flush()
    assert record_outcome(job_id, db_settings, RunOutcome(JobStatus.succeeded), attempt=new) == "succeeded"
    assert rows(db_settings, job_id)[1] == 1


def test_a_slot_learns_it_was_fenced_out_before_it_writes_its_end(
    db_settings: Settings, make_job: JobFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Its renewal thread has not run since it woke up (its run was already gone): the last renewal of
    worker/execute.py, after the thread stopped, finds the newer attempt."""
    job_id = make_job(db_settings, {}, queue="q-fence")
    never = db_settings.model_copy(update={"lease_renew_seconds": 3600.0})  # the thread never renews
    old = LeaseKeeper(job_id, claim(db_settings, job_id), never).start()
    expire_lease(db_settings, job_id)
    assert requeue_or_fail(job_id, db_settings, may_requeue=True, message="lost", attempt=old.attempt) == "queued"
    new = LeaseKeeper(job_id, claim(db_settings, job_id), never).start()
    for keeper in (old, new):
        keeper.stop()
        keeper.confirm()
    assert old.fenced.is_set() and not new.fenced.is_set()
    assert f"attempt {old.attempt} is fenced out (lease renewal refused)" in caplog.text
    assert "fenced out" not in caplog.text.replace(f"attempt {old.attempt} is fenced out", "")


def test_the_sweep_leaves_a_job_whose_lease_was_renewed(db_settings: Settings, make_job: JobFactory) -> None:
    spent = {"resources": {"max_restarts": 0}}
    job_id = make_job(db_settings, spent, status="running", attempts=1, worker="other-host", pid=1)
    with session_scope(db_settings.database_url) as s:
        assert renew_lease(s, job_id, 1, db_settings.lease_seconds)
    assert recover_orphaned_jobs(db_settings) == {}
    expire_lease(db_settings, job_id)
    assert recover_orphaned_jobs(db_settings) == {job_id: "failed"}  # no restarts left: worker_lost
    job = load_job(db_settings, job_id)
    assert (job.status, job.error_reason, job.lease_expires_at) == ("failed", "worker_lost", None)
