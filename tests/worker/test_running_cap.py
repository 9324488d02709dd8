"""The per-owner running-jobs cap at the claim (worker/running_cap.py), on SQLite and PostgreSQL: a job
over the cap stays queued and held, other owners' jobs start, held jobs are sent again as places free
up, and concurrent claims by separate processes never start more than the cap."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from service_core.db.session import get_engine, session_scope
from service_core.settings import Settings
from service_core.status import JobStatus
from worker.execute import claim_job, record_outcome
from worker.outcome import RunOutcome
from worker.running_cap import resend_waiting
from worker.sweeper import sweep

from .conftest import JobFactory, load_job


def capped(settings: Settings, cap: int) -> Settings:
    return settings.model_copy(update={"max_running_per_owner": cap})


def claim(settings: Settings, job_id: str) -> int | None:
    with session_scope(settings.database_url) as s:
        return claim_job(s, job_id, settings.lease_seconds, settings.max_running_per_owner)


def test_a_job_over_its_owners_cap_stays_queued_and_held(db_settings: Settings, make_job: JobFactory) -> None:
    settings = capped(db_settings, 1)
    first, second = make_job(settings), make_job(settings)
    other = make_job(settings, owner="bob")
    assert claim(settings, first) == 1
    assert claim(settings, second) is None
    held = load_job(settings, second)
    assert (held.status, held.attempts, held.enqueued_at) == (JobStatus.queued.value, 0, None)
    assert held.waiting_reason is not None and "TRAINJOBS_MAX_RUNNING_PER_OWNER=1" in held.waiting_reason
    assert claim(settings, other) == 1  # another owner's job goes ahead
    # The refused claim left no trace: no attempt spent, no status event.
    assert held.last_seq == 0


def test_held_jobs_are_sent_again_when_a_place_frees_up(db_settings: Settings, make_job: JobFactory) -> None:
    settings = capped(db_settings, 1)
    first, second, third = make_job(settings), make_job(settings), make_job(settings)
    assert claim(settings, first) == 1
    assert claim(settings, second) is None and claim(settings, third) is None
    assert resend_waiting(settings) == []  # the owner is still at its cap
    assert sweep(settings)["redelivered"] == []  # and the sweep sends nothing either
    record_outcome(first, settings, RunOutcome(JobStatus.succeeded), attempt=1)
    # One place is free: the oldest held job is sent, the other stays held (no pointless re-send).
    assert resend_waiting(settings) == [second]
    sent, still_held = load_job(settings, second), load_job(settings, third)
    assert (sent.waiting_reason, sent.enqueued_at is not None) == (None, True)
    assert still_held.waiting_reason is not None and still_held.enqueued_at is None
    assert claim(settings, second) == 1
    assert claim(settings, third) is None  # the place is taken again


def test_the_sweep_sends_held_jobs_of_owners_below_the_cap(db_settings: Settings, make_job: JobFactory) -> None:
    """The slot whose run ended may die before it sends the held jobs: the sweep does it."""
    settings = capped(db_settings, 1)
    first, second = make_job(settings), make_job(settings)
    assert claim(settings, first) == 1 and claim(settings, second) is None
    record_outcome(first, settings, RunOutcome(JobStatus.failed), attempt=1)
    assert sweep(settings)["redelivered"] == [second]


def test_without_a_cap_held_jobs_all_go(db_settings: Settings, make_job: JobFactory) -> None:
    """An operator who lifts the cap does not leave the jobs it held waiting."""
    settings = capped(db_settings, 1)
    jobs = [make_job(settings) for _ in range(3)]
    assert claim(settings, jobs[0]) == 1
    assert [claim(settings, j) for j in jobs[1:]] == [None, None]
    assert sorted(resend_waiting(capped(settings, 0))) == sorted(jobs[1:])


def _claim_in_process(url: str, job_id: str, barrier: Any, out: Any) -> None:
    settings = Settings.model_validate({"DATABASE_URL": url, "TRAINJOBS_MAX_RUNNING_PER_OWNER": "2"})
    barrier.wait()
    out.put((job_id, claim(settings, job_id)))


def test_concurrent_claims_in_separate_processes_respect_the_cap(
    db_settings: Settings, make_job: JobFactory
) -> None:
    settings = capped(db_settings, 2)
    jobs = [make_job(settings) for _ in range(6)]
    # Forked after the pool is emptied: each process opens connections of its own.
    get_engine(settings.database_url).dispose()
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_process, args=(settings.database_url, j, barrier, out)) for j in jobs]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert sum(1 for attempt in results.values() if attempt is not None) == 2
    statuses = sorted(load_job(settings, j).status for j in jobs)
    assert statuses == [JobStatus.queued.value] * 4 + [JobStatus.running.value] * 2


@pytest.mark.parametrize("db_settings", ["postgresql"], indirect=True)  # SQLite: one writer at a time anyway
def test_on_postgresql_a_claim_waits_for_an_open_claim_of_the_same_owner(
    db_settings: Settings, make_job: JobFactory
) -> None:
    """Deterministic form of the race: the second claim must wait on the owner's lock while the first
    claim's transaction is open (without the lock it would count 0 running jobs and start too)."""
    settings = capped(db_settings, 1)
    first, second = make_job(settings), make_job(settings)
    result: dict[str, int | None] = {}
    waiting = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
    with session_scope(settings.database_url) as open_claim:
        assert claim_job(open_claim, first, 60, 1) == 1  # not committed yet
        thread = threading.Thread(target=lambda: result.update(second=claim(settings, second)))
        thread.start()
        with session_scope(settings.database_url) as observer:
            while observer.execute(waiting).scalar_one() == 0:
                assert thread.is_alive(), f"the second claim did not wait: {result}"
                time.sleep(0.05)
    thread.join(timeout=60)
    assert result == {"second": None}
    assert load_job(settings, second).waiting_reason is not None
