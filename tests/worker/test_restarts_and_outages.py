"""Infrastructure failures resume, user errors do not; a database outage delays a run, never abandons it.

Real parts: real training runs supervised by :func:`worker.execute.execute_job`, SIGKILLed as the
host's OOM killer would; real PostgreSQL cut off behind a TCP proxy (issue 12: restart policy,
database blips)."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import delete, select, text, update
from sqlalchemy.exc import OperationalError

from bench.chaos_proxy import TcpProxy
from service_core.db import Base, Job, JobEvent, MetricPoint
from service_core.db.session import DATABASE_UNAVAILABLE, get_engine, make_engine, session_scope
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from tests.api.test_jobs import drain_broker
from trainer_core.events import make_event
from worker.execute import claim, execute_job, requeue_after_shutdown, session_factory
from worker.ingest import EventIngestor
from worker.outcome import RunOutcome
from worker.paths import host_name, run_paths
from worker.recovery import recover_orphaned_jobs

from .conftest import JobFactory, create_pg_database, drop_pg_database, load_job, make_settings, quick_spec
from .test_recovery import dead_pid
from .test_supervisor import start_in_thread, wait_for


def kill_run_after(settings: Settings, job_id: str, step: int) -> None:
    """SIGKILL the job's run process (only it: its supervisor lives on) once it reached ``step``."""
    wait_for(lambda: load_job(settings, job_id).progress_step >= step, 120, f"step {step}")
    os.kill(int(run_paths(job_id, settings).pid_file.read_text()), signal.SIGKILL)


def status_events(settings: Settings, job_id: str) -> list[dict[str, object]]:
    with session_scope(settings.database_url) as session:
        rows = session.execute(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "status").order_by(JobEvent.seq)
        ).scalars()
        return [dict(row) for row in rows]


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_until_its_restarts_are_spent(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    spec = quick_spec(sentiment_files, num_train_epochs=6, save_steps=2, logging_steps=2, eval_strategy="no")
    spec["resources"] = {"max_restarts": 1}
    job_id = make_job(sqlite_settings, spec)

    thread, result = start_in_thread(job_id, sqlite_settings)
    kill_run_after(sqlite_settings, job_id, 5)
    thread.join(120)
    assert result["status"] == "queued"  # back in the queue, not failed
    requeue = status_events(sqlite_settings, job_id)[-1]
    assert requeue["status"] == "queued" and requeue["reason"] == ErrorReason.worker_lost
    assert "SIGKILL" in str(requeue["message"]) and "restart 1 of 1" in str(requeue["message"])
    resumed_from = int(str(requeue["message"]).split("from checkpoint-")[1].split(",")[0])
    assert resumed_from >= 4

    # The next delivery resumes from the checkpoint (a second kill would now end the job: see below).
    assert execute_job(job_id, sqlite_settings) == "succeeded"
    job = load_job(sqlite_settings, job_id)
    assert (job.status, job.attempts, job.progress_step) == ("succeeded", 2, job.progress_total)
    with session_scope(sqlite_settings.database_url) as session:
        steps = session.execute(
            select(MetricPoint.step).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
            .order_by(MetricPoint.seq)
        ).scalars().all()
    # The killed attempt's points after its checkpoint were dropped and logged anew: one point a step.
    assert steps == list(range(2, job.progress_total + 1, 2))

    # Restarts spent: the same failure now ends the job, saying why.
    spent = make_job(sqlite_settings, {**spec, "resources": {"max_restarts": 0}})
    thread, result = start_in_thread(spent, sqlite_settings)
    kill_run_after(sqlite_settings, spent, 2)
    thread.join(120)
    job = load_job(sqlite_settings, spent)
    assert (result["status"], job.status, job.error_reason) == ("failed", "failed", ErrorReason.worker_lost)
    assert "no restarts left: resources.max_restarts is 0" in (job.error_message or "")


def lost_at_step_4(settings: Settings, make_job: JobFactory, files: dict[str, str], **row: object) -> str:
    """A job whose attempt ran to step 4 (checkpoint-2 and checkpoint-4 on disk) and was lost before
    its step-4 loss point was stored; ``row`` sets the job's fields as that loss left them. Its spec
    now asks for 6 steps, so the resume has steps left to train."""
    spec = quick_spec(files, max_steps=4, save_steps=2, eval_strategy="no")
    job_id = make_job(settings, spec)
    assert execute_job(job_id, settings) == "succeeded"  # leaves checkpoint-2 and checkpoint-4
    with session_scope(settings.database_url) as session:
        session.execute(delete(MetricPoint).where(MetricPoint.job_id == job_id, MetricPoint.step == 4))
        session.execute(update(Job).where(Job.id == job_id).values(
            spec={**spec, "training": {**spec["training"], "max_steps": 6}}, **row))  # fmt: skip
    return job_id


def loss_steps(settings: Settings, job_id: str) -> list[int]:
    with session_scope(settings.database_url) as session:
        return list(session.execute(
            select(MetricPoint.step).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
            .order_by(MetricPoint.seq)
        ).scalars())  # fmt: skip


@pytest.mark.slow
def test_a_resume_matches_the_database_one_loss_point_per_step(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    # Found by the chaos bench (R1, a SIGKILLed slot): the slot died with events it had not written
    # while its run saved a checkpoint on, and the orphan recovery requeued the job without the restart
    # path's rewind: the resumed run logged some steps twice and others not at all.
    # The database holds steps 1..3 (3 is past checkpoint-2), not 4.
    job_id = lost_at_step_4(sqlite_settings, make_job, sentiment_files, status="queued", progress_step=3)
    assert execute_job(job_id, sqlite_settings) == "succeeded"  # from checkpoint-2, not checkpoint-4
    assert sorted(loss_steps(sqlite_settings, job_id)) == list(range(1, 7))  # one point per step


@pytest.mark.slow
def test_a_sweep_requeue_distrusts_the_checkpoint_at_the_stored_step(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    # Found by the chaos bench (R1, a SIGKILLed slot and worker): the dead supervisor had stored step
    # 4's progress but not yet its loss, and its run went on to save checkpoint-4. The sweep requeued
    # the job; the next attempt's claim (its own `running` event) hid that requeue from the resume,
    # which trusted checkpoint-4, and step 4 never got a loss point.
    job_id = lost_at_step_4(sqlite_settings, make_job, sentiment_files, status="running", progress_step=4,
                            worker=host_name(), pid=dead_pid())  # fmt: skip
    assert recover_orphaned_jobs(sqlite_settings) == {job_id: "queued"}
    assert drain_broker(sqlite_settings, load_job(sqlite_settings, job_id).queue) != []
    assert execute_job(job_id, sqlite_settings) == "succeeded"  # from checkpoint-2: 4 is not trusted
    assert sorted(loss_steps(sqlite_settings, job_id)) == list(range(1, 7))  # one point per step


@pytest.mark.slow
def test_a_restart_from_the_start_drops_the_earlier_attempts_points(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    # Found by the chaos bench's long form (R9 production, 2 of 500 jobs): an attempt killed before
    # its first checkpoint had completed had stored steps 1..4; the next attempt started over and
    # logged them again, because the resume only rewound when some checkpoint was left.
    job_id = lost_at_step_4(sqlite_settings, make_job, sentiment_files, status="queued", progress_step=3)
    for checkpoint in run_paths(job_id, sqlite_settings).output_dir.glob("checkpoint-*"):
        shutil.rmtree(checkpoint)  # nothing to resume from: the run starts over
    assert execute_job(job_id, sqlite_settings) == "succeeded"
    assert sorted(loss_steps(sqlite_settings, job_id)) == list(range(1, 7))  # one point per step


@pytest.fixture
def proxied_pg_settings(tmp_path: Path, shared_data_root: Path) -> Iterator[tuple[Settings, TcpProxy]]:
    name, url = create_pg_database("trainjobs_outage")
    Base.metadata.create_all(get_engine(url))
    get_engine(url).dispose()
    home = tmp_path / "var"
    home.mkdir()
    try:
        with TcpProxy(("127.0.0.1", 5432)) as proxy:
            url = url.replace(":5432/", f":{proxy.port}/")
            yield make_settings(home, DATABASE_URL=url, DATA_ROOT=str(shared_data_root)), proxy
    finally:
        drop_pg_database(name)


@pytest.mark.postgres
def test_ingestor_keeps_its_events_through_an_outage(
    proxied_pg_settings: tuple[Settings, TcpProxy], make_job: JobFactory
) -> None:
    settings, proxy = proxied_pg_settings
    job_id = make_job(settings, {"name": "outage"})
    ingestor = EventIngestor(job_id, session_factory(settings), progress_rows_per_s=0)
    ingestor.add(make_event("metric", step=1, values={"loss": 1.0}))
    assert ingestor.flush() == 1
    proxy.cut()
    for step in (2, 3):
        ingestor.add(make_event("metric", step=step, values={"loss": 1.0 / step}))
    with pytest.raises(OperationalError):
        ingestor.flush()
    proxy.restore()
    ingestor.add(make_event("metric", step=4, values={"loss": 0.25}))
    assert ingestor.flush() == 3  # the failed batch, then the new event, in order
    with session_scope(settings.database_url) as session:
        steps = session.execute(
            select(MetricPoint.step).where(MetricPoint.job_id == job_id).order_by(MetricPoint.seq)
        ).scalars().all()
    assert steps == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.postgres
def test_a_run_survives_a_database_outage_and_stores_every_event(
    proxied_pg_settings: tuple[Settings, TcpProxy], make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    settings, proxy = proxied_pg_settings
    # Far longer than the test (a tiny model trains hundreds of steps a second on a quiet machine): the
    # run is cancelled once the database is back, so the outage always falls mid-run.
    spec = quick_spec(sentiment_files, num_train_epochs=5000, eval_strategy="no", logging_steps=1)
    job_id = make_job(settings, spec)
    thread, result = start_in_thread(job_id, settings)
    wait_for(lambda: load_job(settings, job_id).progress_step >= 3, 120, "the run to make progress")
    proxy.cut()
    run_pid = int(run_paths(job_id, settings).pid_file.read_text())
    thread.join(8)  # the database stays away for 8 s while the run trains on
    assert thread.is_alive(), "the supervisor gave up on a healthy run"
    os.kill(run_pid, 0)  # the run itself is still there
    proxy.restore()
    before = load_job(settings, job_id).progress_step
    wait_for(lambda: load_job(settings, job_id).progress_step > before, 60, "progress stored after the outage")
    with session_scope(settings.database_url) as session:  # what `POST /v1/jobs/{id}/cancel` does
        session.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    thread.join(180)
    assert result["status"] == "cancelled"
    job = load_job(settings, job_id)
    with session_scope(settings.database_url) as session:
        steps = session.execute(
            select(MetricPoint.step).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
            .order_by(MetricPoint.seq)
        ).scalars().all()
    assert job.progress_step > before  # it trained through and after the outage
    assert steps == list(range(1, job.progress_step + 1))  # no event lost or repeated across the outage


def test_a_worker_shutdown_before_the_first_checkpoint_requeues_from_the_start(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    # Found by the chaos bench (R9): a worker main killed while a run still loaded its model stopped
    # the slot, which failed the job (worker_lost) for want of a checkpoint; a stop is no fault of the job.
    job_id = make_job(sqlite_settings, quick_spec(sentiment_files))
    claimed = claim(job_id, sqlite_settings)
    assert claimed is not None
    stopped = RunOutcome(JobStatus.cancelled, ErrorReason.shutdown_requeue, stopped_by=ErrorReason.shutdown_requeue)
    paths = run_paths(job_id, sqlite_settings)
    assert requeue_after_shutdown(job_id, sqlite_settings, paths, stopped, claimed[0]) == "queued"
    job = load_job(sqlite_settings, job_id)
    assert (job.status, job.error_reason) == ("queued", None)
    requeue = status_events(sqlite_settings, job_id)[-1]
    assert requeue["reason"] == ErrorReason.shutdown_requeue and "from the start" in str(requeue["message"])
    assert drain_broker(sqlite_settings, job.queue) == [{"task": "trainjobs.run_job", "args": [job_id]}]


@pytest.mark.postgres
def test_a_transaction_the_server_ended_for_idling_is_a_database_blip() -> None:
    """A slot's connections end transactions idle past the lease (worker/main.py). psycopg calls
    that an InternalError; the worker must treat it as the database being away (retry on a new
    connection, fenced by attempt), not as a fatal error that fails a healthy job (chaos R6)."""
    engine = make_engine(
        "postgresql+psycopg://postgres@127.0.0.1:5432/postgres?options=-c idle_in_transaction_session_timeout=200"
    )
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        time.sleep(0.6)  # inside the transaction, past the server's idle timeout
        with pytest.raises(DATABASE_UNAVAILABLE) as caught:
            conn.execute(text("SELECT 2"))
    assert getattr(caught.value.orig, "sqlstate", None) == "25P03"
    with engine.connect() as conn:  # the dead connection left the pool: the next one works
        assert conn.execute(text("SELECT 3")).scalar() == 3
    engine.dispose()
