"""Tables: API keys, datasets, jobs, job events and metric points (SQLAlchemy 2.0 typed models).

The database is the source of truth for job state; the broker only carries job ids.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    select,
)
from sqlalchemy.orm import Mapped, Session, mapped_column

from service_core.db.base import Base, new_id, utcnow
from service_core.status import JobStatus


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    # HMAC-SHA256 of the key under the service secret; the key itself is never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(default=None)
    # A key stops working at expires_at (None: never).
    expires_at: Mapped[datetime | None] = mapped_column(default=None)
    # When an API process last looked the key up in the database (not every request: see api/auth.py).
    last_used_at: Mapped[datetime | None] = mapped_column(default=None)


class Dataset(Base):
    __tablename__ = "datasets"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(256))
    # csv | json | parquet | imagefolder | audiofolder: the `datasets` builder jobs will use
    format: Mapped[str] = mapped_column(String(32))
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # where the stored file or unpacked folder lives, relative to the data root
    storage_path: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        # keyset pagination: newest first, per owner and status
        Index("ix_jobs_owner_created", "owner", "created_at", "id"),
        Index("ix_jobs_status_created", "status", "created_at", "id"),
        # an admin's list of every owner's jobs, newest first: no full sort of a long history
        Index("ix_jobs_created", "created_at", "id"),
        # retention (service_core.retention): finished jobs older than a cutoff
        Index("ix_jobs_finished", "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner: Mapped[str] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16), default=JobStatus.queued.value)
    queue: Mapped[str] = mapped_column(String(64), default="default")
    priority: Mapped[int] = mapped_column(Integer, default=0)
    spec: Mapped[dict[str, Any]] = mapped_column()
    estimate: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    dataset_id: Mapped[str | None] = mapped_column(ForeignKey("datasets.id"), default=None)

    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(default=None)
    finished_at: Mapped[datetime | None] = mapped_column(default=None)

    progress_step: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int | None] = mapped_column(Integer, default=None)
    epoch: Mapped[float | None] = mapped_column(Float, default=None)
    latest_metrics: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    final_metrics: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    measured_memory: Mapped[dict[str, Any] | None] = mapped_column(default=None)

    error_reason: Mapped[str | None] = mapped_column(String(64), default=None)
    error_message: Mapped[str | None] = mapped_column(Text, default=None)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # POST /v1/jobs/{id}/pause on a running job: its slot asks the run to checkpoint and stop, then moves
    # the job to `paused` (worker/execute.py); cleared by that move. A cancel wins over it.
    pause_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    worker: Mapped[str | None] = mapped_column(String(256), default=None)
    pid: Mapped[int | None] = mapped_column(Integer, default=None)
    # Last event sequence number handed out for this job (events and metric points share it).
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    # The running attempt's heartbeat lease (renewed by its slot); the sweep requeues it once past.
    lease_expires_at: Mapped[datetime | None] = mapped_column(default=None)
    # The outbox mark: when the newest queue message for this job was sent (the submit stamps it in
    # its INSERT); NULL means never sent. The sweep re-sends a queued job whose message looks lost.
    enqueued_at: Mapped[datetime | None] = mapped_column(default=None)
    # Why a queued job is held back instead of sent (its owner's running-jobs cap): shown by the API,
    # cleared when the job is sent again (worker/running_cap.py).
    waiting_reason: Mapped[str | None] = mapped_column(Text, default=None)
    # Submitted with an admin key: its run may read every owner's uploads, as the submit's check let it
    # (the run checks its paths again: trainer_core/path_guard.py). Otherwise only its owner's.
    reads_all_uploads: Mapped[bool] = mapped_column(Boolean, default=False)
    # Usage (service_core/usage.py): seconds spent running, over every attempt (started_at is the last
    # attempt's start); the devices each attempt holds; the queue's price when the job was submitted.
    run_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    devices: Mapped[int] = mapped_column(Integer, default=1)
    # resources.num_nodes: above 1, the job runs on a gang of worker slots (worker/gang.py).
    nodes: Mapped[int] = mapped_column(Integer, default=1)
    price_per_device_hour: Mapped[float | None] = mapped_column(Float, default=None)
    # Where the run's trackers show it ({"wandb": url, "mlflow": url}), as the run reported them.
    tracker_links: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # What `auto` chose at submit: [{"field", "value", "why"}] (trainer_core/auto.py); None when nothing was auto.
    auto_choices: Mapped[list[Any] | None] = mapped_column(default=None)
    # The job whose checkpoint this one started from (spec `init_from.job`); that job lists this one.
    init_from_job: Mapped[str | None] = mapped_column(String(32), default=None, index=True)


class JobTotal(Base):
    """A running total over every job that ever finished (``service_core.db.totals`` names the keys).

    Maintained in the transaction of each move to a terminal status and never decreased, so a
    Prometheus scrape reads a few rows instead of the whole history, and retention cannot rewind it.
    """

    __tablename__ = "job_totals"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Double precision: counts stay exact up to 2**53; the duration sum is in seconds.
    value: Mapped[float] = mapped_column(Float, default=0.0)


class IdempotencyKey(Base):
    """The first answer to a submit (``POST /v1/jobs``, ``POST /v1/datasets``) that carried an
    ``Idempotency-Key``: written in the transaction that stores what the submit created, so a client
    that lost the answer (the API killed before it replied) gets it again instead of a second job.

    Kept ``IDEMPOTENCY_TTL`` (api/idempotency.py); a key is its owner's own.
    """

    __tablename__ = "idempotency_keys"
    __table_args__ = (Index("ix_idempotency_keys_owner_created", "owner", "created_at"),)

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    # sha256 of the request (method, path, body): the same key with another request is refused.
    fingerprint: Mapped[str] = mapped_column(String(64))
    status_code: Mapped[int] = mapped_column(Integer)
    response: Mapped[dict[str, Any]] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Lease(Base):
    """A named lease one process holds at a time (the sweeper's): taken when free or expired."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(256))
    expires_at: Mapped[datetime] = mapped_column()


class WorkerHeartbeat(Base):
    """One live worker: the queues its slots consume and whether a slot is idle (for redelivery)."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    queues: Mapped[list[Any]] = mapped_column()
    slots: Mapped[int] = mapped_column(Integer)
    busy: Mapped[int] = mapped_column(Integer, default=0)
    # Since when at least one slot has been idle without a break; NULL while every slot is busy.
    idle_since: Mapped[datetime | None] = mapped_column(default=None)
    heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Its device, for the `auto` micro-batch's budget (trainer_core/auto.py:device_budget): the smallest
    # GPU's memory ("gpu"), or the share of host memory a CPU run may take ("cpu").
    device_memory_gb: Mapped[float | None] = mapped_column(Float, default=None)
    device_kind: Mapped[str | None] = mapped_column(String(8), default=None)
    # Where the other nodes of a multi-node job reach this worker's (TRAINJOBS_ADVERTISE_HOST, worker/gang.py).
    address: Mapped[str | None] = mapped_column(String(256), default=None)


def live_workers(
    session: Session, lease_seconds: float, queue: str | None = None, now: datetime | None = None
) -> list[WorkerHeartbeat]:
    """The workers the service counts as live (a heartbeat within a lease), those serving ``queue`` if
    given: one reading for the sweep, a gang's wait and the API's device budget and node count."""
    live_after = (now or utcnow()) - timedelta(seconds=lease_seconds)
    rows = session.execute(select(WorkerHeartbeat).where(WorkerHeartbeat.heartbeat_at >= live_after)).scalars()
    # queues is a JSON list: filtered here, the same on SQLite and PostgreSQL (a handful of rows)
    return [row for row in rows if queue is None or queue in (row.queues or [])]


class JobNode(Base):
    """One worker slot's place in a multi-node job's gang (worker/gang.py): joined while the job is
    queued, given its node rank when the gang forms, kept under a lease of its own while it runs."""

    __tablename__ = "job_nodes"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    # The slot: "<host>-<pid>"; its worker (main process) "<host>-<parent pid>". A gang takes one slot
    # of each of N different workers.
    slot: Mapped[str] = mapped_column(String(256), primary_key=True)
    worker: Mapped[str] = mapped_column(String(256))
    host: Mapped[str] = mapped_column(String(256))
    pid: Mapped[int] = mapped_column(Integer)
    # The attempt this slot joins (the job's attempts + 1 while forming): its fencing token once running.
    attempt: Mapped[int] = mapped_column(Integer)
    # Where the other nodes reach this one (TRAINJOBS_ADVERTISE_HOST) and a free port there: node 0's
    # pair is the run's rendezvous endpoint.
    address: Mapped[str] = mapped_column(String(256))
    port: Mapped[int] = mapped_column(Integer)
    node: Mapped[int | None] = mapped_column(Integer, default=None)  # its rank, set when the gang forms
    joined_at: Mapped[datetime] = mapped_column(default=utcnow)
    lease_expires_at: Mapped[datetime] = mapped_column()


class JobEvent(Base):
    """Everything a job reported, in order: status changes, progress, metrics, eval, memory, logs.

    ``seq`` is the SSE event id: replaying after ``Last-Event-ID`` is ``seq > last``.
    """

    __tablename__ = "job_events"
    __table_args__ = (UniqueConstraint("job_id", "seq"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))
    data: Mapped[dict[str, Any]] = mapped_column()
    time: Mapped[datetime] = mapped_column(default=utcnow)


class MetricPoint(Base):
    """One value of one named metric at one step; indexed for "points of job J after seq S"."""

    __tablename__ = "metric_points"
    __table_args__ = (
        UniqueConstraint("job_id", "seq", "name"),
        Index("ix_metric_points_job_seq", "job_id", "seq"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(BigInteger)
    step: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[float | None] = mapped_column(Float, default=None)
    name: Mapped[str] = mapped_column(String(64))
    value: Mapped[float | None] = mapped_column(Float, default=None)
    time: Mapped[datetime] = mapped_column(default=utcnow)


class Webhook(Base):
    """An owner's endpoint for job events, signed per the Standard Webhooks specification.

    The secret is kept because each delivery is signed with it; the API shows it once, at creation
    and at rotation.
    """

    __tablename__ = "webhooks"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    owner: Mapped[str] = mapped_column(String(128), index=True)
    url: Mapped[str] = mapped_column(Text)
    # the event types it receives ("job.succeeded", "checkpoint.created", ...)
    events: Mapped[list[Any]] = mapped_column()
    description: Mapped[str] = mapped_column(Text, default="")
    secret: Mapped[str] = mapped_column(String(128))
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # why it was disabled (the endpoint answered 410 Gone), shown by the API
    disabled_reason: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WebhookDelivery(Base):
    """One event for one webhook: the durable outbox row a sender claims, sends and retries.

    Written in the transaction that makes the event happen, so an API or worker restart loses none.
    """

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        # the sender's scan: due deliveries, oldest first
        Index("ix_webhook_deliveries_state_next", "state", "next_attempt_at"),
        # a webhook's delivery list, newest first
        Index("ix_webhook_deliveries_webhook_created", "webhook_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_id)
    webhook_id: Mapped[str] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(String(32), default=None, index=True)
    # orders one job's deliveries to one webhook (a per-database sequence would do; this is portable)
    seq: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), default=0)
    event_type: Mapped[str] = mapped_column(String(64))
    payload: Mapped[dict[str, Any]] = mapped_column()
    # pending | delivered | failed (gave up after the retry window) | disabled (the webhook was)
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    # the sender that holds it, until when (a lease per delivery: one sender at a time)
    claimed_by: Mapped[str | None] = mapped_column(String(256), default=None)
    claimed_until: Mapped[datetime | None] = mapped_column(default=None)
    # every attempt: [{"at", "status_code", "error", "duration_ms"}]
    attempt_log: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(default=None)
