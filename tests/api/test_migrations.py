"""``alembic upgrade head`` on an empty database gives exactly the models' schema."""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from service_core.db.base import Base
from service_core.db.totals import bucket_key, duration_bucket, finished_key
from service_core.status import JobStatus
from tests.api.conftest import PG_SERVER

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    name = f"trainjobs_test_mig_{secrets.token_hex(6)}"
    server = create_engine(f"{PG_SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with server.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        server.dispose()


def alembic_config(url: str) -> Config:
    config = Config(str(REPO / "alembic.ini"))
    config.set_main_option("sqlalchemy.url", url)
    config.attributes["configure_logger"] = False
    return config


def test_upgrade_head_matches_the_models(empty_database: str) -> None:
    command.upgrade(alembic_config(empty_database), "head")
    engine = create_engine(empty_database)
    with engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert differences == []
    assert tables == set(Base.metadata.tables) | {"alembic_version"}


def test_downgrade_removes_everything(empty_database: str) -> None:
    config = alembic_config(empty_database)
    command.upgrade(config, "head")
    command.downgrade(config, "base")
    engine = create_engine(empty_database)
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()


def test_one_linear_chain_from_the_initial_revision() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    assert len(script.get_heads()) == 1
    revisions = list(script.walk_revisions())  # head first
    assert revisions[-1].revision == "0001"
    for newer, older in itertools.pairwise(revisions):
        assert newer.down_revision == older.revision


def jobs_indexes(url: str) -> dict[str, list[str]]:
    engine = create_engine(url)
    with engine.connect() as conn:
        found = {ix["name"]: list(ix["column_names"]) for ix in inspect(conn).get_indexes("jobs")}
    engine.dispose()
    return found


# 0004 (history indexes): the admin list across owners and retention by finish time.
HISTORY_INDEXES = {"ix_jobs_created": ["created_at", "id"], "ix_jobs_finished": ["finished_at"]}


def test_history_indexes_added_over_existing_jobs_and_removed_by_downgrade(empty_database: str) -> None:
    config = alembic_config(empty_database)
    command.upgrade(config, "0001")
    engine = create_engine(empty_database)
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO jobs (id, owner, name, status, queue, priority, spec, created_at, updated_at, "
            "progress_step, attempts, cancel_requested, last_seq) VALUES ('j1', 'alice', 'n', 'succeeded', "
            "'default', 0, '{}', '2026-01-01 00:00:00+00:00', '2026-01-01 00:00:00+00:00', 0, 0, false, 0)"
        ))  # fmt: skip
    assert not set(HISTORY_INDEXES) & set(jobs_indexes(empty_database))

    command.upgrade(config, "0004")
    found = jobs_indexes(empty_database)
    assert {name: found.get(name) for name in HISTORY_INDEXES} == HISTORY_INDEXES
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs")).scalars().all() == ["j1"]  # data untouched

    command.downgrade(config, "0001")
    assert not set(HISTORY_INDEXES) & set(jobs_indexes(empty_database))
    engine.dispose()


# 0006 (job totals): the running totals behind /metrics, filled from the jobs already stored.
def test_job_totals_filled_from_existing_jobs_and_removed_by_downgrade(empty_database: str) -> None:
    config = alembic_config(empty_database)
    command.upgrade(config, "0004")
    engine = create_engine(empty_database)
    rows = [  # (id, status, started_at, finished_at): a 45 s run, a 2 h run, a cancel while queued, a live one
        ("j1", "succeeded", "2026-01-01 00:00:00+00:00", "2026-01-01 00:00:45+00:00"),
        ("j2", "failed", "2026-01-01 00:00:00+00:00", "2026-01-01 02:00:00+00:00"),
        ("j3", "cancelled", None, "2026-01-01 00:00:00+00:00"),
        ("j4", "running", "2026-01-01 00:00:00+00:00", None),
    ]
    with engine.begin() as conn:
        for job_id, status, started, finished in rows:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, owner, name, status, queue, priority, spec, created_at, updated_at, "
                    "started_at, finished_at, progress_step, attempts, cancel_requested, last_seq) VALUES (:id, "
                    "'alice', 'n', :status, 'default', 0, '{}', '2026-01-01 00:00:00+00:00', "
                    "'2026-01-01 00:00:00+00:00', :started, :finished, 0, 0, false, 0)"
                ),
                {"id": job_id, "status": status, "started": started, "finished": finished},
            )
    command.upgrade(config, "0006")
    with engine.connect() as conn:
        totals = dict(conn.execute(text("SELECT key, value FROM job_totals")).tuples().all())
    # The keys and buckets the running code maintains (service_core.db.totals).
    assert {key: value for key, value in totals.items() if key != "duration_sum"} == {
        finished_key(JobStatus.succeeded): 1,
        finished_key(JobStatus.failed): 1,
        finished_key(JobStatus.cancelled): 1,
        bucket_key(duration_bucket(45)): 1,
        bucket_key(duration_bucket(7200)): 1,
    }
    assert abs(totals["duration_sum"] - (45 + 7200)) < 0.01

    command.downgrade(config, "0005")
    with engine.connect() as conn:
        assert "job_totals" not in inspect(conn).get_table_names()
        assert len(conn.execute(text("SELECT id FROM jobs")).all()) == 4  # data untouched
    engine.dispose()
