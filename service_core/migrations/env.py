"""Alembic environment: the models' metadata, and the URL from ``DATABASE_URL`` (service_core.settings).

``render_as_batch`` lets later migrations alter SQLite tables (copy-and-move); it changes nothing
on PostgreSQL.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, create_engine, pool

import service_core.db.models  # noqa: F401  (registers every table on Base.metadata)
from service_core.db.base import Base
from service_core.settings import get_settings

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or get_settings().database_url


def configure(connection: Connection | None = None) -> None:
    if connection is None:
        context.configure(
            url=database_url(),
            literal_binds=True,
            target_metadata=target_metadata,
            render_as_batch=True,
            compare_type=True,
        )
    else:
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=True, compare_type=True
        )


def run_migrations_offline() -> None:
    configure()
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # A caller may hand over its own connection (tests); otherwise open one for this run.
    connection = config.attributes.get("connection")
    if connection is not None:
        configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(database_url(), poolclass=pool.NullPool)  # one-shot: keep nothing open
    with engine.connect() as conn:
        configure(conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
