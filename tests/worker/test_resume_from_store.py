"""A run on an object-store artifacts root (real SeaweedFS, real PostgreSQL) killed after its checkpoint
reached the store resumes on a disk without it, from the store: exact final steps, one loss point a step."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from service_core.checkpoints import CheckpointStore
from service_core.db import Base, MetricPoint
from service_core.db.session import get_engine, session_scope
from service_core.settings import Settings
from worker.execute import execute_job
from worker.paths import run_paths

from .conftest import JobFactory, create_pg_database, drop_pg_database, load_job, make_settings, quick_spec
from .test_restarts_and_outages import status_events
from .test_supervisor import start_in_thread, wait_for


@pytest.fixture
def pg_s3_settings(tmp_path: Path, s3_root: str, shared_data_root: Path) -> Iterator[Settings]:
    """A worker's settings on a fresh PostgreSQL database with its artifacts in the object store."""
    name, url = create_pg_database("trainjobs_store")
    Base.metadata.create_all(get_engine(url))
    home = tmp_path / "var"
    home.mkdir()
    try:
        yield make_settings(home, DATABASE_URL=url, ARTIFACTS_ROOT=s3_root, DATA_ROOT=str(shared_data_root))
    finally:
        get_engine(url).dispose()
        drop_pg_database(name)


def loss_points(settings: Settings, job_id: str) -> list[tuple[int, int]]:
    """``(id, step)`` of the job's loss points, in the order they were stored."""
    with session_scope(settings.database_url) as session:
        rows = session.execute(
            select(MetricPoint.id, MetricPoint.step).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
            .order_by(MetricPoint.seq)
        ).all()  # fmt: skip
    return [(int(row_id), int(step)) for row_id, step in rows]


@pytest.mark.slow
@pytest.mark.postgres
def test_a_killed_run_resumes_from_the_store_on_a_disk_without_its_checkpoint(
    pg_s3_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    settings = pg_s3_settings
    # 128 steps: long enough that the step-8 checkpoint's upload lands mid-run on a loaded machine too.
    spec = quick_spec(sentiment_files, num_train_epochs=16, save_steps=4, save_total_limit=2, eval_strategy="no")
    job_id = make_job(settings, spec)
    store, paths = CheckpointStore(settings.artifacts_root, job_id), run_paths(job_id, settings)

    thread, result = start_in_thread(job_id, settings)
    wait_for(lambda: max(store.steps(), default=0) >= 8, 180, "a checkpoint of step 8 in the store")
    os.killpg(int(paths.pid_file.read_text()), signal.SIGKILL)  # the run's whole process group
    thread.join(120)
    assert result["status"] == "queued"
    message = str(status_events(settings, job_id)[-1]["message"])
    resumed_from = int(message.split("restarting from checkpoint-")[1].split(",")[0])
    assert resumed_from >= 8 and resumed_from in store.steps()
    assert len(store.steps()) <= 2  # save_total_limit holds in the store

    # The next attempt runs where the first one's disk is not: only the store has the checkpoint.
    shutil.rmtree(paths.work_dir)
    kept = [point for point in loss_points(settings, job_id) if point[1] <= resumed_from]
    with caplog.at_level(logging.INFO, logger="worker.checkpoint_sync"):
        assert execute_job(job_id, settings) == "succeeded"
    assert f"fetched checkpoint {resumed_from} from the store" in caplog.text

    job = load_job(settings, job_id)
    assert (job.attempts, job.progress_step, job.progress_total) == (2, 128, 128)  # an uninterrupted run's steps
    points = loss_points(settings, job_id)
    assert [step for _, step in points] == list(range(1, 129))  # no gap, no duplicate
    # Resumed, not started over: the first attempt's points up to the checkpoint are the very same rows.
    assert points[:resumed_from] == kept
