"""Structured logs for the API and the worker: JSON lines when not on a terminal, text when on one.

The worker wraps the handling of a job in ``with job_context(job_id):`` so that every line logged
meanwhile (by any module, in that thread or task) carries ``job_id`` without passing it around.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TextIO

_current_job: ContextVar[str | None] = ContextVar("trainjobs_job_id", default=None)
# A worker slot runs one job at a time; threads it starts (output readers) do not inherit context
# variables, so the slot also records its job process-wide.
_process_job: list[str] = []


@contextmanager
def job_context(job_id: str, *, process_wide: bool = False) -> Iterator[None]:
    """Tag every log record emitted inside the block with ``job_id``.

    ``process_wide`` also tags records from threads without a job of their own (for a process that
    runs one job at a time, such as a worker slot).
    """
    token = _current_job.set(job_id)
    if process_wide:
        _process_job.append(job_id)
    try:
        yield
    finally:
        _current_job.reset(token)
        if process_wide:
            _process_job.remove(job_id)


def current_job_id() -> str | None:
    """The job the current code works for, if any."""
    return _current_job.get() or (_process_job[-1] if _process_job else None)


class JobContextFilter(logging.Filter):
    """Sets ``record.job_id`` from the context (an explicit ``extra={"job_id": ...}`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "job_id", None) is None:
            record.job_id = current_job_id()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, job_id (when set) and exception."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        job_id = getattr(record, "job_id", None)
        if job_id is not None:
            entry["job_id"] = job_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return jsonlib.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines for a terminal, with ``[job <id>]`` when a job is in context."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(job)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        job_id = getattr(record, "job_id", None)
        record.job = f" [job {job_id}]" if job_id else ""
        return super().format(record)


def configure_logging(json: bool | None = None, level: int = logging.INFO, stream: TextIO | None = None) -> None:
    """Route the root logger to ``stream`` (stderr); ``json=None`` means JSON exactly when it is not a TTY."""
    out = stream if stream is not None else sys.stderr
    use_json = (not out.isatty()) if json is None else json
    handler = logging.StreamHandler(out)
    handler.addFilter(JobContextFilter())
    handler.setFormatter(JsonFormatter() if use_json else TextFormatter())
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
