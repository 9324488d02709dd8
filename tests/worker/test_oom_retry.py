"""A run that runs out of device memory is retried with a smaller configuration of the same effective batch.

Driven on the CPU by the testing fault ``TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH`` (read only by the
training process): real runs, a real SQLite database and the embedded broker.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from service_core.db import JobEvent
from service_core.db.session import session_scope
from service_core.settings import Settings
from trainer_core.oom_fault import FAULT_OOM_ENV
from worker.execute import execute_job

from .conftest import JobFactory, load_job, quick_spec

pytestmark = pytest.mark.slow  # five short training runs in subprocesses


def retry_events(settings: Settings, job_id: str) -> list[dict[str, Any]]:
    with session_scope(settings.database_url) as session:
        rows = session.execute(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "retry").order_by(JobEvent.seq)
        ).scalars()
        return [dict(row.data) for row in rows]


def test_an_oom_is_retried_with_half_the_micro_batch_and_succeeds(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_OOM_ENV, "4")
    job_id = make_job(sqlite_settings, quick_spec(sentiment_files, per_device_train_batch_size=8, max_steps=4))
    assert execute_job(job_id, sqlite_settings) == "queued"  # the first attempt ran out, the job went back
    assert execute_job(job_id, sqlite_settings) == "succeeded"

    job = load_job(sqlite_settings, job_id)
    assert job.attempts == 2 and job.error_reason is None
    training, efficiency = job.spec["training"], job.spec["efficiency"]
    assert (training["per_device_train_batch_size"], efficiency["gradient_accumulation_steps"]) == (4, 2)
    [retry] = retry_events(sqlite_settings, job_id)
    assert retry["reason"] == "out_of_memory" and retry["attempt"] == 1
    assert (retry["micro_batch"], retry["gradient_accumulation_steps"]) == (8, 1)  # same effective batch: 8
    assert retry["changes"] == {"training.per_device_train_batch_size": 4, "efficiency.gradient_accumulation_steps": 2}
    assert "fault injected" in retry["message"]


def test_out_of_retries_fails_with_out_of_memory_and_the_plan(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_OOM_ENV, "1")
    spec = quick_spec(sentiment_files, per_device_train_batch_size=8, max_steps=4)
    spec["resources"] = {"max_oom_retries": 1}
    job_id = make_job(sqlite_settings, spec)
    assert execute_job(job_id, sqlite_settings) == "queued"
    assert execute_job(job_id, sqlite_settings) == "failed"
    job = load_job(sqlite_settings, job_id)
    assert job.error_reason == "out_of_memory" and job.error_message is not None
    assert "after 1 out-of-memory retry" in job.error_message
    assert "training.per_device_train_batch_size=2, efficiency.gradient_accumulation_steps=4" in job.error_message
    assert len(retry_events(sqlite_settings, job_id)) == 1


def test_max_oom_retries_zero_fails_at_once(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAULT_OOM_ENV, "4")
    spec = quick_spec(sentiment_files, per_device_train_batch_size=8, max_steps=4)
    spec["resources"] = {"max_oom_retries": 0}
    job_id = make_job(sqlite_settings, spec)
    assert execute_job(job_id, sqlite_settings) == "failed"
    assert load_job(sqlite_settings, job_id).error_reason == "out_of_memory"
    assert retry_events(sqlite_settings, job_id) == []
