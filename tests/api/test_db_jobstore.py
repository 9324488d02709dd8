"""Status moves only forward, event numbers never collide, and a plain submit is one guarded INSERT,
on SQLite and PostgreSQL alike."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session, sessionmaker

from service_core.db import Base, Job, JobEvent
from service_core.db.base import utcnow
from service_core.db.jobstore import add_events, insert_plain_job, transition
from service_core.db.models import Webhook
from service_core.db.session import make_engine
from service_core.status import JobStatus

pytestmark = pytest.mark.both_databases

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        eng = make_engine(f"sqlite:///{tmp_path / 'jobs.db'}")
        Base.metadata.create_all(eng)
        yield eng
        eng.dispose()
        return
    name = f"trainjobs_jobstore_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    eng = make_engine(f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}")
    Base.metadata.create_all(eng)
    try:
        yield eng
    finally:
        eng.dispose()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def new_job(engine: Engine) -> str:
    with Session(engine) as session:
        job = Job(owner="alice", name="j", spec={})
        session.add(job)
        session.commit()
        return job.id


def status_of(engine: Engine, job_id: str) -> str:
    with Session(engine) as session:
        return session.execute(select(Job.status).where(Job.id == job_id)).scalar_one()


def test_status_moves_forward_and_terminal_is_final(engine: Engine) -> None:
    job_id = new_job(engine)
    with Session(engine) as s, s.begin():
        assert transition(s, job_id, JobStatus.running)
    with Session(engine) as s, s.begin():
        assert transition(s, job_id, JobStatus.succeeded, reason=None)
    for later in (JobStatus.running, JobStatus.failed, JobStatus.cancelled, JobStatus.queued):
        with Session(engine) as s, s.begin():
            assert not transition(s, job_id, later)
    assert status_of(engine, job_id) == "succeeded"
    with Session(engine) as s:
        job = s.get(Job, job_id)
        assert job is not None and job.started_at is not None and job.finished_at is not None
        kinds = s.execute(select(JobEvent.data).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).scalars()
        assert [d["status"] for d in kinds] == ["running", "succeeded"]


def test_expect_makes_the_claim_a_compare_and_set(engine: Engine) -> None:
    job_id = new_job(engine)
    with Session(engine) as s, s.begin():
        assert transition(s, job_id, JobStatus.running, expect=JobStatus.queued)
    # a redelivered message tries to claim the same job again: it must lose
    with Session(engine) as s, s.begin():
        assert not transition(s, job_id, JobStatus.running, expect=JobStatus.queued)
    with Session(engine) as s, s.begin():
        assert not transition(s, "no-such-job", JobStatus.running)


def test_concurrent_writers_get_distinct_consecutive_seqs(engine: Engine) -> None:
    job_id = new_job(engine)
    make = sessionmaker(bind=engine)

    def write(batch: int) -> int:
        with make() as s, s.begin():
            return add_events(s, job_id, [("log", {"batch": batch, "i": i}, None) for i in range(5)])

    with ThreadPoolExecutor(max_workers=4) as pool:
        lasts = list(pool.map(write, range(8)))
    with Session(engine) as s:
        seqs = list(s.execute(select(JobEvent.seq).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).scalars())
        job = s.get(Job, job_id)
        assert job is not None
    assert seqs == list(range(1, 41))
    assert sorted(lasts) == [5 * (i + 1) for i in range(8)]
    assert job.last_seq == 40


def test_a_plain_submit_is_one_insert_guarded_by_the_quota_and_the_owners_webhooks(engine: Engine) -> None:
    """Stored, with every column as given or defaulted, while the owner has fewer queued jobs than the
    limit and no enabled webhook; otherwise nothing is stored and the caller takes the full path."""
    spec = {"task": "text-classification", "nested": {"a": [1, 2.5, None]}}

    def submit(owner: str, limit: int) -> Job | None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            return insert_plain_job(conn, limit, owner=owner, name="j", spec=spec, created_at=utcnow())

    def stored(owner: str) -> list[Job]:
        with Session(engine) as session:
            return list(session.execute(select(Job).where(Job.owner == owner)).scalars())

    first = submit("alice", 2)
    assert first is not None and first.status == JobStatus.queued.value
    (row,) = stored("alice")
    assert (row.id, row.spec, row.status, row.attempts) == (first.id, spec, "queued", first.attempts)
    assert submit("alice", 2) is not None
    assert submit("alice", 2) is None  # two queued: the quota's limit; nothing stored
    assert len(stored("alice")) == 2
    assert submit("alice", 0) is not None  # 0: no limit
    assert len(stored("alice")) == 3

    with Session(engine) as session:
        session.add(Webhook(owner="bob", url="http://127.0.0.1:9/hook", secret="s" * 32, events=["job.queued"],
                            enabled=False))  # fmt: skip
        session.commit()
    assert submit("bob", 0) is not None  # a disabled webhook queues no deliveries
    with Session(engine) as session:
        session.execute(update(Webhook).where(Webhook.owner == "bob").values(enabled=True))
        session.commit()
    assert submit("bob", 0) is None  # deliveries must commit with the job: the full path stores it
    assert len(stored("bob")) == 1
