"""``alembic upgrade head`` on an empty database gives exactly the models' schema; the scripts ship in the
package (service_core/migrations), and ``schema_problem`` tells a missing or outdated database apart.

The packaged config (what ``trainjobs migrate`` runs) is the one under test; the repository's
``alembic.ini`` must name the same folder, so developers' ``alembic`` commands see the same scripts."""

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
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from service_core.db.base import Base
from service_core.db.totals import bucket_key, duration_bucket, finished_key
from service_core.migrations import SCRIPT_LOCATION, alembic_config, apply_migrations, schema_problem
from service_core.status import JobStatus
from tests.api.conftest import PG_SERVER

pytestmark = pytest.mark.both_databases

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


def test_the_repository_alembic_ini_names_the_packaged_scripts() -> None:
    developers = ScriptDirectory.from_config(Config(str(REPO / "alembic.ini")))
    assert Path(developers.dir).resolve() == SCRIPT_LOCATION
    assert not list((REPO / "migrations").glob("**/*.py")), "one copy of the migrations: service_core/migrations"


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


def test_schema_problem_says_missing_then_behind_and_migrate_brings_it_to_head(empty_database: str) -> None:
    head = ScriptDirectory.from_config(alembic_config(empty_database)).get_current_head()
    first = schema_problem(empty_database)
    if empty_database.startswith("sqlite"):  # the file is not there yet, and asking must not create it
        assert first == f"database {empty_database} does not exist: run `trainjobs migrate`"
        assert not Path(empty_database.removeprefix("sqlite:///")).exists()
    else:
        assert first == f"database {empty_database} has no trainjobs schema yet: run `trainjobs migrate`"

    command.upgrade(alembic_config(empty_database), "0003")
    assert schema_problem(empty_database) == (
        f"database {empty_database} is at revision 0003, behind this trainjobs ({head}): run `trainjobs migrate`"
    )
    done = apply_migrations(empty_database)
    assert (done.before, done.after) == ("0003", head)
    assert schema_problem(empty_database) is None
    assert apply_migrations(empty_database).before == head  # a second run has nothing to do

    engine = create_engine(empty_database)
    with engine.begin() as conn:  # as a newer trainjobs would leave it
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    assert schema_problem(empty_database) == (
        f"database {empty_database} is at revision 9999, newer than this trainjobs ({head}): upgrade trainjobs"
    )


def test_schema_problem_accepts_a_schema_made_from_the_models(tmp_path: Path) -> None:
    # Tests and benchmarks create tables straight from the models: no revision, but nothing missing.
    url = f"sqlite:///{tmp_path / 'models.db'}"
    engine = create_engine(url)
    Base.metadata.create_all(engine)
    assert schema_problem(url) is None
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE api_keys"))
    engine.dispose()
    assert schema_problem(url) == f"database {url} has no trainjobs schema yet: run `trainjobs migrate`"


@pytest.mark.postgres
def test_schema_problem_names_a_missing_postgres_database_without_its_password() -> None:
    url = f"{PG_SERVER.replace('postgres@', 'postgres:s3cret-pw@')}/trainjobs_never_created_{secrets.token_hex(4)}"
    problem = schema_problem(url)
    assert problem is not None and "s3cret-pw" not in problem
    assert problem == (
        f"database {url.replace('s3cret-pw', '***')} does not exist: create it, then run `trainjobs migrate`"
    )
    assert schema_problem(url.replace(":5432/", ":1/")) is None  # unreachable: the processes wait it out
