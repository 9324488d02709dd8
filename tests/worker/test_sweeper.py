"""The sweep: one sweeper at a time through a lease row, worker heartbeat rows, and the outbox
re-send of queued jobs whose message was never sent or looks lost, without piling up duplicates."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from bench.chaos_proxy import TcpProxy
from service_core.db import Base, Job
from service_core.db.base import utcnow
from service_core.db.models import JobNode, Lease, WorkerHeartbeat
from service_core.db.session import get_engine, session_scope
from service_core.settings import Settings
from worker.paths import host_name
from worker.sweeper import SWEEPER_LEASE, Sweeper, beat, redeliver_lost_messages, release_lease, take_lease

from .conftest import JobFactory, create_pg_database, drop_pg_database, load_job, make_settings
from .test_recovery import queued_ids


def test_one_sweeper_holds_the_lease_until_it_expires(db_settings: Settings) -> None:
    assert take_lease(db_settings, SWEEPER_LEASE, "a", 60)
    assert not take_lease(db_settings, SWEEPER_LEASE, "b", 60)
    assert take_lease(db_settings, SWEEPER_LEASE, "a", 60)  # the holder renews
    with session_scope(db_settings.database_url) as s:  # a dies: its lease runs out
        s.execute(update(Lease).values(expires_at=utcnow() - timedelta(seconds=1)))
    assert take_lease(db_settings, SWEEPER_LEASE, "b", 60)
    assert not take_lease(db_settings, SWEEPER_LEASE, "a", 60)
    release_lease(db_settings, SWEEPER_LEASE, "b")
    assert take_lease(db_settings, SWEEPER_LEASE, "a", 60)


def test_heartbeat_rows_count_busy_slots_and_idle_time(db_settings: Settings, make_job: JobFactory) -> None:
    slot = os.getpid()
    make_job(db_settings, status="running", attempts=1, worker=host_name(), pid=slot)
    beat(db_settings, "w1", ["q"], [slot, slot + 1])
    with session_scope(db_settings.database_url) as s:
        row = s.execute(select(WorkerHeartbeat)).scalar_one()
        assert (row.name, row.queues, row.slots, row.busy) == ("w1", ["q"], 2, 1)
        first_idle = row.idle_since
    assert first_idle is not None
    beat(db_settings, "w1", ["q"], [slot, slot + 1])
    assert load_worker(db_settings).idle_since == first_idle  # still idle since then
    beat(db_settings, "w1", ["q"], [slot])
    assert load_worker(db_settings).idle_since is None  # every slot busy
    # A slot in a multi-node job's gang, forming or running, is busy too; the row says where nodes meet it.
    gang_job = make_job(db_settings, nodes=2)
    with session_scope(db_settings.database_url) as s:
        s.add(JobNode(job_id=gang_job, slot="s2", worker="w1", host=host_name(), pid=slot + 1, attempt=1,
                      address="10.0.0.5", port=29400, lease_expires_at=utcnow()))  # fmt: skip
    beat(db_settings, "w1", ["q"], [slot, slot + 1], address="10.0.0.5")
    worker = load_worker(db_settings)
    assert (worker.busy, worker.idle_since, worker.address) == (2, None, "10.0.0.5")


def load_worker(settings: Settings) -> WorkerHeartbeat:
    with session_scope(settings.database_url) as s:
        return s.execute(select(WorkerHeartbeat)).scalar_one()


def age(settings: Settings, job_id: str, seconds: float, *, sent: bool) -> None:
    then = utcnow() - timedelta(seconds=seconds)
    with session_scope(settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(created_at=then, enqueued_at=then if sent else None))


def test_lost_messages_are_sent_again_once_per_idle_slot(db_settings: Settings, make_job: JobFactory) -> None:
    queue = f"q-out-{os.getpid()}"
    never_sent, young = make_job(db_settings, queue=queue), make_job(db_settings, queue=queue)
    sent_low, sent_high = make_job(db_settings, queue=queue), make_job(db_settings, queue=queue, priority=5)
    unserved = make_job(db_settings, queue="nobody-consumes-this")
    for job_id in (never_sent, unserved):
        age(db_settings, job_id, 120, sent=False)
    for job_id in (sent_low, sent_high):
        age(db_settings, job_id, 120, sent=True)
    # One worker with one slot, busy on another job: only the job never sent goes out.
    slot = os.getpid()
    make_job(db_settings, status="running", attempts=1, worker=host_name(), pid=slot, queue=queue)
    beat(db_settings, "w1", [queue], [slot])
    assert redeliver_lost_messages(db_settings) == [never_sent]
    assert redeliver_lost_messages(db_settings) == []  # stamped: not again
    # The slot is free and stays idle for two heartbeats: its queue's message must be gone.
    beat(db_settings, "w1", [queue], [slot + 1])
    assert redeliver_lost_messages(db_settings) == []  # idle only just now
    with session_scope(db_settings.database_url) as s:
        idle_since = utcnow() - timedelta(seconds=3 * db_settings.lease_renew_seconds)
        s.execute(update(WorkerHeartbeat).values(idle_since=idle_since))
    assert redeliver_lost_messages(db_settings) == [sent_high]  # one idle slot, one message, highest first
    assert sorted(queued_ids(db_settings, queue)) == sorted([never_sent, sent_high])
    assert load_job(db_settings, young).enqueued_at is None  # younger than the bound: left alone


def test_a_stopping_worker_leaves_the_registry(db_settings: Settings) -> None:
    sweeper = Sweeper(db_settings, ["q"], "w-stop")
    sweeper.slot_pids = [os.getpid()]
    sweeper.tick(0.0)  # heartbeat, and the sweep: it takes the free sweeper lease
    with session_scope(db_settings.database_url) as s:
        assert s.execute(select(Lease.holder)).scalar_one() == "w-stop"
    assert load_worker(db_settings).name == "w-stop"
    sweeper.close()
    with session_scope(db_settings.database_url) as s:
        assert s.execute(select(WorkerHeartbeat)).first() is None
        assert s.execute(select(Lease)).first() is None


@pytest.mark.postgres
def test_after_a_database_outage_the_sweep_gives_slots_time_to_renew(tmp_path: Path, make_job: JobFactory) -> None:
    name, direct_url = create_pg_database("trainjobs_sweep_outage")
    Base.metadata.create_all(get_engine(direct_url))
    try:
        with TcpProxy(("127.0.0.1", 5432)) as proxy:
            url = direct_url.replace(":5432/", f":{proxy.port}/")
            settings = make_settings(tmp_path, DATABASE_URL=url)
            job_id = make_job(settings, status="running", attempts=1, worker="other-host", pid=1)
            with session_scope(url) as s:  # its lease ran out while the database was away
                s.execute(update(Job).values(lease_expires_at=utcnow() - timedelta(seconds=1)))
            sweeper = Sweeper(settings, ["q"], "w-outage")
            proxy.cut()
            sweeper.tick(0.0)  # fails: logged, not raised
            proxy.restore()
            sweeper.tick(sweeper.next_sweep)  # back: the slot may not have renewed yet
            assert load_job(settings, job_id).status == "running"
            sweeper.tick(sweeper.next_sweep + 2 * settings.lease_renew_seconds)
            assert load_job(settings, job_id).status == "queued"  # still not renewed: lost, runs again
            get_engine(url).dispose()
    finally:
        get_engine(direct_url).dispose()
        drop_pg_database(name)
