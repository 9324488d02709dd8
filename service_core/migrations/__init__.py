"""The database schema's Alembic migrations, shipped inside the package.

``env.py``, ``script.py.mako`` and ``versions/`` are the Alembic script folder: ``trainjobs migrate`` and
``trainjobs dev`` run them from here (an installed package has no ``alembic.ini``), developers through
the repository's ``alembic.ini``, which points here too. :func:`schema_problem` is what ``trainjobs
serve`` and ``trainjobs worker`` ask before they start.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine, inspect, make_url, pool
from sqlalchemy.exc import OperationalError

SCRIPT_LOCATION = Path(__file__).resolve().parent
MIGRATE_HINT = "run `trainjobs migrate`"


def redact_url(database_url: str) -> str:
    """The URL as it may be printed: the password replaced by ``***``."""
    return make_url(database_url).render_as_string(hide_password=True)


def alembic_config(database_url: str) -> Config:
    """An Alembic config built in code on the packaged scripts, for ``database_url``."""
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))  # ConfigParser interpolation
    config.attributes["configure_logger"] = False  # keep the caller's logging as it is
    return config


def head_revision() -> str:
    """The newest revision this package knows."""
    head = ScriptDirectory(str(SCRIPT_LOCATION)).get_current_head()
    assert head is not None, "the packaged migrations have no head"
    return head


def current_revision(database_url: str) -> str | None:
    """The database's revision (None: never migrated). Connects, so the database must be reachable."""
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _sqlite_file(database_url: str) -> Path | None:
    url = make_url(database_url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


@dataclass(frozen=True)
class Migrated:
    """What :func:`apply_migrations` did: the revision before (None: an empty database) and after."""

    before: str | None
    after: str


def apply_migrations(database_url: str) -> Migrated:
    """``alembic upgrade head`` on ``database_url`` with the packaged scripts."""
    sqlite_file = _sqlite_file(database_url)
    if sqlite_file is not None:
        sqlite_file.parent.mkdir(parents=True, exist_ok=True)  # SQLite makes the file, not its folder
    before = current_revision(database_url)
    command.upgrade(alembic_config(database_url), "head")
    after = current_revision(database_url)
    assert after is not None, "alembic upgrade head left no revision"
    return Migrated(before, after)


def schema_problem(database_url: str) -> str | None:
    """One line saying the database is missing or behind the package's migrations, else None.

    A database that cannot be reached right now is not reported: the API and the worker ride out
    database outages (README "Operations"), so they start and wait for it. A schema made straight from
    the models (``create_all``, as tests and benchmarks do) has every table and no revision: accepted.
    """
    shown = redact_url(database_url)
    sqlite_file = _sqlite_file(database_url)
    if sqlite_file is not None and not sqlite_file.is_file():  # connecting would create an empty file
        return f"database {shown} does not exist: {MIGRATE_HINT}"
    head = head_revision()
    engine = create_engine(database_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            revision = MigrationContext.configure(conn).get_current_revision()
            tables = set(inspect(conn).get_table_names())
    except OperationalError as exc:
        if f'database "{make_url(database_url).database}" does not exist' in str(exc.orig):  # PostgreSQL
            return f"database {shown} does not exist: create it, then {MIGRATE_HINT}"
        return None
    finally:
        engine.dispose()
    if revision == head:
        return None
    if revision is None:
        import service_core.db.models  # noqa: F401  (registers every table on Base.metadata)
        from service_core.db.base import Base

        if set(Base.metadata.tables) <= tables:
            return None
        return f"database {shown} has no trainjobs schema yet: {MIGRATE_HINT}"
    try:
        ScriptDirectory(str(SCRIPT_LOCATION)).get_revision(revision)
    except CommandError:  # a revision this package does not have: a newer trainjobs migrated it
        return f"database {shown} is at revision {revision}, newer than this trainjobs ({head}): upgrade trainjobs"
    return f"database {shown} is at revision {revision}, behind this trainjobs ({head}): {MIGRATE_HINT}"
