"""Persistence: typed SQLAlchemy models and sessions (their Alembic migrations: service_core/migrations).

The status vocabulary the models use lives in :mod:`service_core.status`; import it from there.
"""

from service_core.db.base import Base
from service_core.db.models import ApiKey, Dataset, Job, JobEvent, MetricPoint
from service_core.db.session import allocate_seqs, get_engine, get_sessionmaker, session_scope

__all__ = [
    "ApiKey",
    "Base",
    "Dataset",
    "Job",
    "JobEvent",
    "MetricPoint",
    "allocate_seqs",
    "get_engine",
    "get_sessionmaker",
    "session_scope",
]
