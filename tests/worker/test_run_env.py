"""A training run gets an allow-listed environment: never the service's secrets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import update

from service_core.db import Job
from service_core.db.session import session_scope
from service_core.settings import Settings
from worker.execute import run_paths
from worker.procfs import environ
from worker.run_env import TRACKER_VARS, run_env, spec_trackers

from .conftest import JobFactory, load_job, quick_spec
from .test_supervisor import start_in_thread, wait_for

SECRETS = {
    "TRAINJOBS_SECRET_KEY": "s3cret-signing-key",
    "TRAINJOBS_API_KEY": "admin-key-must-not-leak",
    "DATABASE_URL": "postgresql+psycopg://trainjobs:dbpass@db.internal/trainjobs",
    "BROKER_URL": "redis://:brokerpass@redis.internal:6379/0",
}


def test_run_env_keeps_what_training_needs_and_drops_the_rest() -> None:
    worker = {
        **SECRETS,
        "PATH": "/usr/bin",
        "HF_HOME": "/cache/hf",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "PYTHONPATH": "/srv",
        "TRAINJOBS_FAULT_CRASH_AT_STEP": "3",
        "AWS_SECRET_ACCESS_KEY": "aws",
        "WANDB_API_KEY": "wandb",
        "TRAINJOBS_RUN_ENV_EXTRA": "WANDB_*, DATABASE_URL",
    }
    assert run_env(worker) == {
        "PATH": "/usr/bin",
        "HF_HOME": "/cache/hf",
        "LC_ALL": "C.UTF-8",
        "CUDA_VISIBLE_DEVICES": "0",
        "PYTHONPATH": "/srv",
        "TRAINJOBS_FAULT_CRASH_AT_STEP": "3",
        "WANDB_API_KEY": "wandb",  # named by the operator; DATABASE_URL is refused even then
    }


TRACKER_ENV = {
    "WANDB_API_KEY": "wandb-key", "WANDB_MODE": "offline", "WANDB_DIR": "/srv/wandb", "WANDB_BASE_URL": "https://wb",
    "MLFLOW_TRACKING_URI": "https://mlflow.example.com", "MLFLOW_TRACKING_USERNAME": "u",
    "MLFLOW_TRACKING_PASSWORD": "p", "MLFLOW_TRACKING_TOKEN": "t",
}  # fmt: skip


@pytest.mark.parametrize("trackers", [[], ["tensorboard"], ["wandb"], ["mlflow"], ["wandb", "mlflow"]])
def test_a_tracker_key_reaches_only_runs_that_report_to_it(trackers: list[str]) -> None:
    env = run_env({**SECRETS, **TRACKER_ENV, "PATH": "/usr/bin", "WANDB_ENTITY_SECRET": "x"}, trackers)
    wanted = set().union(*(TRACKER_VARS[t] for t in trackers if t in TRACKER_VARS))
    assert env == {"PATH": "/usr/bin", **{k: v for k, v in TRACKER_ENV.items() if k in wanted}}


def test_the_trackers_come_from_the_stored_spec(tmp_path: Path) -> None:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"name": "x", "training": {"report_to": ["wandb"]}}))
    assert spec_trackers(spec_file) == ["wandb"]
    spec_file.write_text(json.dumps({"name": "x"}))
    assert spec_trackers(spec_file) == []


@pytest.mark.slow
def test_a_real_run_has_no_service_secrets_in_its_environment(
    sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAINJOBS_FAULT_NOTHING", "1")  # testing aids do get through
    job_id = make_job(sqlite_settings, quick_spec(sentiment_files, num_train_epochs=200))
    thread, result = start_in_thread(job_id, sqlite_settings)
    wait_for(lambda: load_job(sqlite_settings, job_id).progress_step >= 1, 90, "the run to make progress")
    env = environ(int(run_paths(job_id, sqlite_settings).pid_file.read_text()))
    with session_scope(sqlite_settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    thread.join(60)
    assert result["status"] == "cancelled"
    assert not set(SECRETS) & set(env), sorted(env)
    assert not any(value in "".join(env.values()) for value in SECRETS.values())
    assert env["TRAINJOBS_FAULT_NOTHING"] == "1" and env["PYTHONUNBUFFERED"] == "1" and "PATH" in env
