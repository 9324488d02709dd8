"""The Celery task a slot runs: a job id in, :func:`worker.execute.execute_job` called, nothing returned.

The database holds the job; the message holds only its id, validated here before anything runs.
When the slot is asked to shut down while a job runs (its worker stopping), the run is told to
checkpoint and stop and the job goes back to the queue (see ``execute_job``'s ``should_stop``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import signals
from celery.exceptions import Reject
from pydantic import BaseModel, Field

from service_core.logging import configure_logging, job_context
from service_core.queue import TASK_NAME
from service_core.settings import get_settings
from worker.celery_app import app
from worker.execute import execute_job
from worker.forkserver import start_fork_server, stop_fork_server
from worker.run_env import run_environment

log = logging.getLogger(__name__)

# Set from Celery's shutdown signal handler in this slot (a solo-pool Celery worker process), read by
# the running job's supervisor loop: a threading.Event is safe to set from a signal handler.
_shutting_down = threading.Event()


class JobMessage(BaseModel):
    job_id: str = Field(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$")


@signals.setup_logging.connect
def _setup_logging(**_: Any) -> None:
    # Structured logs instead of Celery's (JSON off a terminal); connecting here stops Celery's own.
    configure_logging()


@signals.worker_init.connect
def _start_fork_server(**_: Any) -> None:
    # Before the first message: the imports happen while the slot waits for work.
    settings = get_settings()
    if settings.prewarm_runs:
        start_fork_server(run_environment(os.environ), settings.zygote_parent)


@signals.worker_shutdown.connect
def _stop_fork_server(**_: Any) -> None:
    stop_fork_server()


@signals.worker_shutting_down.connect
def _on_slot_shutting_down(**_: Any) -> None:
    _shutting_down.set()


# The registered name stays TASK_NAME ("trainjobs.run_job"), whatever this function is called: it is
# the wire name in every queued message, and one an older API queued must still find this task.
@app.task(name=TASK_NAME, ignore_result=True)
def handle_job_message(job_id: str) -> None:
    """Execute job ``job_id`` if it is still queued (a redelivery of a started job is ignored)."""
    message = JobMessage(job_id=job_id)
    if _shutting_down.is_set():
        # A message taken while the slot stops (it still drains one): hand it back untouched
        # rather than start a run only to stop it again.
        raise Reject("slot shutting down", requeue=True)
    with job_context(message.job_id, process_wide=True):  # job_id on every line logged meanwhile
        execute_job(message.job_id, get_settings(), should_stop=_shutting_down.is_set)
