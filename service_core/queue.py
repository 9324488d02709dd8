"""The one Celery configuration, and how a job is put on a queue (the sending half; worker/celery_app.py consumes).

The broker only carries job ids; the database is the source of truth for job state, so there is no
result backend. Reliability settings follow Airflow's Celery executor: late acks (a message is
acknowledged only after its job finished), reject on worker lost, prefetch 1 (a slot never holds a
second job it cannot start), JSON only, and a visibility timeout longer than the longest allowed job
so Redis never redelivers a job that is still running.

``BROKER_URL`` selects Redis in production; the default is kombu's SQLAlchemy transport on a SQLite
file (``sqla+sqlite:///var/broker.db``), an embedded broker with no server to run. That transport
has no message priorities: jobs on it start in submission order.

This module imports neither torch nor the training code: the API and the worker's recovery import it
to enqueue.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from celery import Celery

from service_core.settings import Settings, get_settings

# The task's wire name, in every queued message (worker/tasks.py:handle_job_message consumes it). It
# never changes with the Python names: a message an older API queued must still find its task.
TASK_NAME = "trainjobs.run_job"
# kombu's Redis transport with a reused publishing client (see service_core.redis_transport).
REDIS_TRANSPORT = "service_core.redis_transport:Transport"
# Job priorities run 0..9, higher starts first (AMQP's convention).
MIN_PRIORITY, MAX_PRIORITY = 0, 9

_apps: dict[tuple[str, int, str], Celery] = {}
_apps_lock = threading.Lock()


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://", "redis+socket://"))


def celery_config(settings: Settings) -> dict[str, Any]:
    """The Celery settings for ``settings``; every reliability choice is spelled out here."""
    url = settings.broker_url
    transport_options: dict[str, Any]
    if url.startswith(("sqla+", "sqlalchemy+")):
        # kombu's SQLAlchemy transport passes its options to create_engine (an unknown key is a
        # TypeError) and has no visibility timeout: it never redelivers by time. A message taken by
        # a worker that dies is restored only on a clean shutdown; worker.recovery covers the rest.
        transport_options = {"connect_args": {"timeout": 30}} if "sqlite" in url else {}
    else:
        transport_options = {"visibility_timeout": settings.visibility_timeout_s}
    if is_redis(url):
        # One Redis list per priority level, polled in order (the default merges 10 levels into 4).
        transport_options.update(priority_steps=list(range(MAX_PRIORITY + 1)), queue_order_strategy="priority")
    return {
        "broker_url": url,
        # Only for plain redis:// and rediss:// URLs; anything else keeps kombu's choice by scheme.
        "broker_transport": REDIS_TRANSPORT if url.startswith(("redis://", "rediss://")) else None,
        "broker_transport_options": transport_options,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "result_backend": None,
        "task_default_queue": settings.default_queue,
        "task_routes": {TASK_NAME: {"queue": settings.default_queue}},
        "task_create_missing_queues": True,
        "task_queue_max_priority": MAX_PRIORITY,
        "task_default_priority": MIN_PRIORITY,
        "worker_hijack_root_logger": False,
        "worker_send_task_events": False,
        "worker_enable_remote_control": is_redis(url),
        "broker_connection_max_retries": None,
    }


def make_celery(settings: Settings) -> Celery:
    """A Celery app configured for ``settings`` (the worker adds its task module to it)."""
    app = Celery("trainjobs", set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


def celery_for(settings: Settings) -> Celery:
    """The process-wide app for these broker settings, built once (it holds the connection pool)."""
    key = (settings.broker_url, settings.visibility_timeout_s, settings.default_queue)
    with _apps_lock:
        if key not in _apps:
            _apps[key] = make_celery(settings)
        return _apps[key]


def broker_priority(priority: int, broker_url: str) -> int:
    """Map a job priority (0..9, higher first) to the broker's own scale (Redis: lower first)."""
    clamped = max(MIN_PRIORITY, min(MAX_PRIORITY, int(priority)))
    return MAX_PRIORITY - clamped if is_redis(broker_url) else clamped


def enqueue_job(job_id: str, queue: str, priority: int, settings: Settings | None = None) -> None:
    """Send job ``job_id`` to ``queue``; a worker slot consuming that queue will claim and run it.

    The message is only the id: the worker reads everything else from the database, and a second
    delivery of the same id is harmless (the claim is a compare-and-set on the job's status).
    """
    settings = settings or get_settings()
    app = celery_for(settings)
    app.send_task(
        TASK_NAME,
        args=[job_id],
        queue=queue,
        routing_key=queue,
        priority=broker_priority(priority, settings.broker_url),
        ignore_result=True,
        # What monitoring shows for the arguments; given, Celery skips its saferepr of them.
        argsrepr=repr([job_id]),
        kwargsrepr="{}",
    )


def send_once(
    settings: Settings, job_id: str, queue: str, priority: int, where: Sequence[Any], values: dict[str, Any]
) -> bool:
    """Stamp the job's row (an UPDATE on ``where``, setting ``values``) and send it only if the stamp took.

    A compare-and-set on the row: two senders racing on the same job (a slot and the sweep, two sweeps,
    a sweep and a requeue) never both send it. Returns whether this one did.
    """
    from sqlalchemy import update

    from service_core.db.models import Job
    from service_core.db.session import session_scope

    with session_scope(settings.database_url) as session:
        stamped = session.execute(update(Job).where(Job.id == job_id, *where).values(**values))
    if stamped.rowcount != 1:  # type: ignore[attr-defined]
        return False
    enqueue_job(job_id, queue, priority, settings)
    return True
