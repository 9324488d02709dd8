"""Persistence: typed SQLAlchemy models and sessions (Alembic migrations live in migrations/)."""

from service_core.db.base import Base
from service_core.db.models import (
    TERMINAL_STATUSES,
    ApiKey,
    Dataset,
    Job,
    JobEvent,
    JobStatus,
    MetricPoint,
    can_transition,
)
from service_core.db.session import allocate_seqs, get_engine, get_sessionmaker, session_scope

__all__ = [
    "TERMINAL_STATUSES",
    "ApiKey",
    "Base",
    "Dataset",
    "Job",
    "JobEvent",
    "JobStatus",
    "MetricPoint",
    "allocate_seqs",
    "can_transition",
    "get_engine",
    "get_sessionmaker",
    "session_scope",
]
