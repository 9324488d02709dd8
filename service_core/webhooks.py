"""Webhooks: the event types, the signing rule, the URL rule, and the outbox writes.

One source of truth for what a webhook may subscribe to, how a delivery is signed (Standard Webhooks:
``webhook-id``, ``webhook-timestamp``, ``webhook-signature``) and when its URL may be reached. The API
(api/routes/webhooks.py) checks and stores webhooks; the job store (service_core/db/jobstore.py)
calls :func:`record_job_event` in the transaction that changes a job, so an event and its deliveries
commit together or not at all; the worker's sender (worker/webhook_sender.py) sends them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import Connection, insert, select
from sqlalchemy.orm import Session

from service_core.db.base import new_id, utcnow
from service_core.db.models import Job, Webhook, WebhookDelivery
from service_core.settings import get_settings
from service_core.status import JobStatus
from trainer_core.net_guard import host_problem

# One event type per status (``job.paused`` included: a person paused the job), and checkpoints. A job
# that went back to the queue (its slot shut down, it was lost, it is retried smaller) is ``job.queued``
# again, with the reason in the payload.
CHECKPOINT_CREATED = "checkpoint.created"
EVENT_TYPES: tuple[str, ...] = (*(f"job.{status.value}" for status in JobStatus), CHECKPOINT_CREATED)

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32
# How long a delivery is retried after it was created, and the longest wait between two attempts.
RETRY_WINDOW = timedelta(hours=24)
MAX_BACKOFF_S = 3600.0

PENDING, DELIVERED, FAILED, DISABLED = "pending", "delivered", "failed", "disabled"
DELIVERY_STATES = (PENDING, DELIVERED, FAILED, DISABLED)

Resolver = Callable[..., list[Any]]


def status_event_type(new: JobStatus) -> str:
    """The webhook event of a move to ``new``."""
    return f"job.{new.value}"


def new_secret() -> str:
    """A signing secret in the Standard Webhooks form: ``whsec_`` and base64 of random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header value: ``v1,`` + base64 HMAC-SHA256 of ``id.timestamp.body``."""
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    digest = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def url_problem(url: str, *, allow_private: bool, resolve: Resolver | None = None) -> str | None:
    """Why ``url`` may not be a webhook's target (scheme, host, a non-public name or address), or None.

    The public-address rule is trainer_core/net_guard.py's, the same as for data URLs; the sender
    applies it again before every attempt, to the addresses it then connects to.
    """
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in url):
        return "must not contain spaces or control characters"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  # raises ValueError for a port out of range
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return "must be an http or https URL"
    if not parts.hostname:
        return "has no host"
    if parts.username is not None or parts.password is not None:
        return "must not hold credentials (sign-in goes by the signature)"
    if allow_private:
        return None
    try:
        problem = host_problem(parts.hostname, resolve=resolve)
    except (ValueError, UnicodeError) as exc:  # a name no resolver takes (NUL, an over-long label)
        return f"host {parts.hostname!r} is not a valid name ({exc})"
    if problem:
        return f"host {parts.hostname} {problem} (webhooks reach public addresses only)"
    return None


def dashboard_url(job_id: str, public_url: str | None) -> str:
    """Where the dashboard shows the job: absolute with ``TRAINJOBS_PUBLIC_URL``, else a path."""
    return f"{(public_url or '').rstrip('/')}/dashboard#/jobs/{job_id}"


def event_payload(
    event_type: str, job: Any, at: datetime, public_url: str | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON body of one event: ``{type, timestamp, data}``; never a secret or a spec."""
    data: dict[str, Any] = {
        "job_id": job.id,
        "name": job.name,
        "status": job.status,
        "reason": job.error_reason,
        "message": job.error_message,
        "final_metrics": job.final_metrics,
        "dashboard_url": dashboard_url(job.id, public_url),
        **(extra or {}),
    }
    return {"type": event_type, "timestamp": at.isoformat().replace("+00:00", "Z"), "data": data}


def owner_wants(db: Session | Connection, owner: str, event_type: str) -> bool:
    """Whether an enabled webhook of ``owner`` subscribes to ``event_type`` (one indexed SELECT)."""
    rows = db.execute(select(Webhook.events).where(Webhook.owner == owner, Webhook.enabled.is_(True))).scalars()
    return any(event_type in (events or []) for events in rows)


def record_job_event(
    db: Session | Connection,
    job_id: str,
    event_type: str,
    seq: int,
    *,
    extra: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> int:
    """Queue one delivery of ``event_type`` for each enabled webhook of the job's owner that wants it.

    Called inside the transaction that makes the event happen. One SELECT (the owner's enabled webhooks
    joined with the job as it now is); one INSERT when any matches. ``seq`` (the job event's) orders
    one job's deliveries. ``extra`` overrides data fields (a status event's reason, a checkpoint's step).
    Returns the number of deliveries queued.
    """
    job_columns = (Job.id, Job.name, Job.status, Job.error_reason, Job.error_message, Job.final_metrics)
    rows = db.execute(
        select(Webhook.id.label("webhook_id"), Webhook.events, *job_columns)
        .join(Job, Job.owner == Webhook.owner)
        .where(Job.id == job_id, Webhook.enabled.is_(True))
    ).all()
    targets = [row for row in rows if event_type in (row.events or [])]
    if not targets:
        return 0
    at = at or utcnow()
    payload = event_payload(event_type, targets[0], at, get_settings().public_url, extra)
    db.execute(
        insert(WebhookDelivery),
        [new_delivery(row.webhook_id, job_id, seq, event_type, payload, at) for row in targets],
    )
    return len(targets)


def new_delivery(
    webhook_id: str, job_id: str | None, seq: int, event_type: str, payload: dict[str, Any], at: datetime
) -> dict[str, Any]:
    """The column values of a fresh pending delivery (also a redelivery's: same payload, new attempts)."""
    return {
        "id": new_id(), "webhook_id": webhook_id, "job_id": job_id, "seq": seq, "event_type": event_type,
        "payload": payload, "state": PENDING, "attempts": 0, "next_attempt_at": at, "claimed_by": None,
        "claimed_until": None, "attempt_log": [], "created_at": at, "delivered_at": None,
    }  # fmt: skip
