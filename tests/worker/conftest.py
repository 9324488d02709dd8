"""Worker fixtures: fresh databases (SQLite file or a new PostgreSQL database), settings pointing at
them, job factories, and tiny training specs on data the tests write."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

from service_core.db import Base, Job
from service_core.db.session import get_engine, session_scope
from service_core.settings import Settings
from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from worker import forkserver
from worker.procfs import all_processes

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def create_pg_database(prefix: str) -> tuple[str, str]:
    """A new, empty PostgreSQL database; returns ``(name, sqlalchemy url)``."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def drop_pg_database(name: str) -> None:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def make_settings(home: Path, **env: str) -> Settings:
    """Settings as a deployment would give them (environment variable names), rooted at ``home``."""
    return Settings.model_validate({"TRAINJOBS_HOME": str(home), "TRAINJOBS_CANCEL_GRACE_SECONDS": "20", **env})


@pytest.fixture(scope="session", autouse=True)
def _worker_runs_are_forked(warm_runs: forkserver.ForkServer) -> None:
    """The worker tests drive real runs in-process (``execute_job``): forked, as in a slot."""


@pytest.fixture(scope="session")
def shared_data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data root of the settings below, for the whole session: the jobs the tests make read the
    session's data files (:func:`sentiment_files`), and a run may read nothing outside its data root
    (trainer_core/path_guard.py)."""
    return tmp_path_factory.mktemp("data")


@pytest.fixture(params=["sqlite", "postgresql"])
def db_settings(request: pytest.FixtureRequest, tmp_path: Path, shared_data_root: Path) -> Iterator[Settings]:
    """Settings on a fresh database of each kind, schema created from the models."""
    home = tmp_path / "var"
    home.mkdir()
    if request.param == "sqlite":
        settings = make_settings(home, DATA_ROOT=str(shared_data_root))
        Base.metadata.create_all(get_engine(settings.database_url))
        yield settings
        get_engine(settings.database_url).dispose()
        return
    name, url = create_pg_database("trainjobs_worker")
    settings = make_settings(home, DATABASE_URL=url, DATA_ROOT=str(shared_data_root))
    Base.metadata.create_all(get_engine(url))
    try:
        yield settings
    finally:
        get_engine(url).dispose()
        drop_pg_database(name)


@pytest.fixture
def sqlite_settings(tmp_path: Path, shared_data_root: Path) -> Iterator[Settings]:
    """Settings on the embedded defaults (SQLite database and broker under a temporary home)."""
    home = tmp_path / "var"
    home.mkdir()
    settings = make_settings(home, DATA_ROOT=str(shared_data_root))
    Base.metadata.create_all(get_engine(settings.database_url))
    yield settings
    get_engine(settings.database_url).dispose()


JobFactory = Callable[..., str]


@pytest.fixture
def make_job() -> JobFactory:
    """Insert a job row (queued unless told otherwise) and return its id."""

    def factory(settings: Settings, spec: dict[str, Any] | None = None, owner: str = "alice", **fields: Any) -> str:
        with session_scope(settings.database_url) as session:
            job = Job(owner=owner, name=(spec or {}).get("name", "job"), spec=spec or {}, **fields)
            session.add(job)
            session.flush()
            return job.id

    return factory


def load_job(settings: Settings, job_id: str) -> Job:
    with session_scope(settings.database_url) as session:
        return session.execute(select(Job).where(Job.id == job_id)).scalar_one()


@pytest.fixture(scope="session")
def sentiment_files(shared_data_root: Path) -> dict[str, str]:
    return write_sentiment_csv(shared_data_root / "sentiment", n_train=64, n_val=16)


def quick_spec(files: dict[str, str], **training: Any) -> dict[str, Any]:
    """A tiny config-built BERT run of a few seconds (8 steps), or longer with ``training`` overrides."""
    base = {"num_train_epochs": 1, "per_device_train_batch_size": 8, "logging_steps": 1, "save_steps": 1000}
    return tiny_text_spec(files, training={**base, **training})


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid`` (zombies excluded)."""
    return [p.pid for p in all_processes() if p.alive and p.pgid == pgid]
