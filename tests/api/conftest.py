"""API test fixtures: an app per test on SQLite or PostgreSQL, keys for two users and an admin.

Every test runs on SQLite. Tests marked ``both_databases`` (where the two behave differently: JSONB,
LISTEN/NOTIFY, row locks, keyset plans, text NULs, the connection pool, migrations) run on PostgreSQL
too. PostgreSQL gets one fresh database per test session (``trainjobs_test_<random>``), dropped at
the end; each test starts from empty tables. SQLite gets a file per test. The broker is the embedded
one (kombu's SQLAlchemy transport on a SQLite file in the test's folder).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from api.main import create_app
from service_core.db.base import Base
from service_core.db.models import Job
from service_core.keys import create_api_key
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.trainer_core.datagen import write_sentiment_csv

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
UPLOAD_LIMIT_MB = 1


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database with the models' tables, dropped when the session ends."""
    name = f"trainjobs_test_{secrets.token_hex(6)}"
    server = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = f"{PG_SERVER}/{name}"
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()
    try:
        yield url
    finally:
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        server.dispose()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """SQLite for every test; PostgreSQL as well where the test is marked ``both_databases``."""
    chosen = any("database_url" in str(mark.args[0]) for mark in metafunc.definition.iter_markers("parametrize"))
    if "database_url" in metafunc.fixturenames and not chosen:  # a test may name its database itself
        both = metafunc.definition.get_closest_marker("both_databases") is not None
        metafunc.parametrize("database_url", BACKENDS if both else ["sqlite"], indirect=True)


@pytest.fixture
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'service_core.db'}"
        engine = create_engine(url)
        Base.metadata.create_all(engine)
        engine.dispose()
        return url
    url = str(request.getfixturevalue("pg_url"))
    engine = create_engine(url)
    with engine.begin() as conn:
        tables = ", ".join(t.name for t in Base.metadata.sorted_tables)
        conn.execute(text(f"TRUNCATE {tables} CASCADE"))
    engine.dispose()
    return url


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    (tmp_path / "data").mkdir()
    # The data make_spec() names: submits run preflight, which reads it.
    write_sentiment_csv(tmp_path / "data" / "reviews", n_train=32, n_val=8)
    return Settings.model_validate(
        {
            "TRAINJOBS_HOME": tmp_path,
            "DATABASE_URL": database_url,
            "BROKER_URL": f"sqla+sqlite:///{tmp_path / 'broker.db'}",
            "ARTIFACTS_ROOT": str(tmp_path / "artifacts"),
            "DATA_ROOT": tmp_path / "data",
            "TRAINJOBS_SECRET_KEY": "test-secret-" + secrets.token_hex(8),
            "TRAINJOBS_MAX_UPLOAD_MB": UPLOAD_LIMIT_MB,
            "TRAINJOBS_QUEUE_BUDGETS": {"gpu-1g": 1.0},
        }
    )


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture
def session(app: FastAPI) -> Iterator[Session]:
    """A session on the app's database, for arranging rows and checking what routes stored."""
    with app.state.sessionmaker() as db:
        yield db


@dataclass(frozen=True)
class Keys:
    admin: str
    alice: str
    bob: str

    @staticmethod
    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys(app: FastAPI, settings: Settings) -> Keys:
    with app.state.sessionmaker() as db:
        made = Keys(
            admin=create_api_key(db, "root", True, settings=settings),
            alice=create_api_key(db, "alice", settings=settings),
            bob=create_api_key(db, "bob", settings=settings),
        )
        db.commit()
    return made


def make_spec(**overrides: Any) -> dict[str, Any]:
    """A small valid spec: a tiny config-built BERT on a CSV under the data root."""
    spec: dict[str, Any] = {
        "name": "tiny-bert",
        "task": "text-classification",
        "model": {
            "config": {
                "model_type": "bert",
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 128,
            }
        },
        "dataset": {"path": "csv", "data_files": {"train": "reviews/train.csv"}},
        "training": {"max_steps": 4, "per_device_train_batch_size": 4},
    }
    spec.update(overrides)
    return spec


def add_job(db: Session, owner: str, status: JobStatus = JobStatus.queued, **fields: Any) -> Job:
    """A job row as the API would store it (for tests of routes other than submit)."""
    job = Job(owner=owner, name=fields.pop("name", "job"), spec=make_spec(), status=status.value, **fields)
    db.add(job)
    db.commit()
    return job
