"""Send webhook deliveries: a thread in every worker's main process (``trainjobs worker``, and so ``trainjobs dev``).

Every ``TRAINJOBS_WEBHOOK_POLL_SECONDS`` the sender claims due deliveries, each with a lease of its own
(``claimed_by``, ``claimed_until``: one conditional UPDATE, so exactly one sender holds a delivery, on
SQLite and PostgreSQL alike; a sender that dies mid-send leaves a lease that runs out, and another
picks the delivery up). Of one job's deliveries to one webhook only the oldest undelivered one is
due: a later event waits while an earlier one is pending, so a receiver sees a job's events in order.

An attempt resolves the URL's host once, refuses it unless every answer is public (the rule of
trainer_core/net_guard.py, unless ``TRAINJOBS_ALLOW_PRIVATE_TARGETS``), and connects to that checked
address, with the name as Host header and TLS server name: a DNS answer that changes between the
check and the connection (rebinding) cannot send it elsewhere. Redirects are not followed.

Outcomes: 2xx delivered; 410 Gone disables the webhook and its pending deliveries; anything else
(another status, a timeout, a refused address) is retried after ``base * 2**(attempts-1)`` seconds
with full jitter, capped at an hour, until 24 hours after the delivery was created, then failed.
"""

from __future__ import annotations

import json
import logging
import random
import socket
import threading
import time
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import and_, exists, or_, select, update
from sqlalchemy.orm import aliased

from service_core.db.base import as_utc, utcnow
from service_core.db.models import Webhook, WebhookDelivery
from service_core.db.session import session_scope
from service_core.settings import Settings
from service_core.webhooks import (
    DELIVERED,
    DISABLED,
    FAILED,
    MAX_BACKOFF_S,
    PENDING,
    RETRY_WINDOW,
    Resolver,
    sign,
)
from trainer_core.net_guard import ForbiddenAddress, ip_problem, name_problem, normalized

log = logging.getLogger(__name__)

ATTEMPT_TIMEOUT_S = 10.0
# A claim outlives the longest attempt (connect, write and read each bounded by the timeout) with room.
CLAIM_S = 6 * ATTEMPT_TIMEOUT_S
BATCH = 20


def backoff_s(attempts: int, base_s: float) -> float:
    """The wait before the next attempt after ``attempts`` failed ones: full jitter on a doubling cap."""
    return random.uniform(0.0, min(MAX_BACKOFF_S, base_s * 2 ** min(attempts - 1, 32)))


def pinned_address(host: str, port: int, *, allow_private: bool, resolve: Resolver) -> str:
    """The one address an attempt connects to: ``host`` resolved once, every answer checked.

    Raises :class:`ForbiddenAddress` for a host the public-address rule refuses (by name, or any answer).
    """
    name = normalized(host)
    if not allow_private and (problem := name_problem(name)):
        raise ForbiddenAddress(f"refused: {name} {problem}")
    infos = resolve(name, port, proto=socket.IPPROTO_TCP)
    if not infos:
        raise OSError(f"{name} did not resolve")
    if not allow_private:
        for info in infos:
            if problem := ip_problem(str(info[4][0])):
                raise ForbiddenAddress(f"refused: {name} {problem}")
    return str(infos[0][4][0]).split("%")[0]


class WebhookSender:
    """Claims and sends due deliveries; ``run_once`` for one pass, ``start``/``stop`` for the thread."""

    def __init__(self, settings: Settings, name: str, *, resolve: Resolver | None = None) -> None:
        self.settings, self.name = settings, name
        self.resolve: Resolver = resolve or socket.getaddrinfo
        # No kept-alive connections: each attempt connects to the address it has just checked (a pooled
        # connection is keyed by that address alone, not by the name it was checked for).
        self.client = httpx.Client(
            timeout=ATTEMPT_TIMEOUT_S, follow_redirects=False, trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="webhook-sender", daemon=True)

    def start(self) -> WebhookSender:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=ATTEMPT_TIMEOUT_S)  # an attempt cut short keeps its claim until it expires
        self.client.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                sent = self.run_once()
            except Exception:  # a database blip: the deliveries wait in their table
                log.exception("webhook sender %s: a pass failed", self.name)
                sent = 0
            if not sent:
                self._stop.wait(self.settings.webhook_poll_seconds)

    def run_once(self) -> int:
        """Claim the due deliveries (up to a batch) and attempt each; returns how many were attempted."""
        attempted = 0
        for delivery_id in self.due():
            if self._stop.is_set():
                break
            if self.claim(delivery_id):
                self.attempt(delivery_id)
                attempted += 1
        return attempted

    def due(self) -> list[str]:
        """Pending deliveries due now and unclaimed, each the oldest pending one of its job and webhook."""
        now = utcnow()
        earlier = aliased(WebhookDelivery)
        d = WebhookDelivery
        before = or_(
            earlier.seq < d.seq,
            and_(earlier.seq == d.seq, earlier.created_at < d.created_at),
            and_(earlier.seq == d.seq, earlier.created_at == d.created_at, earlier.id < d.id),
        )
        waits = exists().where(
            earlier.webhook_id == d.webhook_id, earlier.job_id == d.job_id, earlier.state == PENDING, before
        )
        query = (
            select(d.id)
            .where(d.state == PENDING, d.next_attempt_at <= now, self._unclaimed(d, now), ~waits)
            .order_by(d.next_attempt_at)
            .limit(BATCH)
        )
        with session_scope(self.settings.database_url) as session:
            return list(session.execute(query).scalars())

    @staticmethod
    def _unclaimed(d: Any, now: datetime) -> Any:
        return or_(d.claimed_until.is_(None), d.claimed_until < now)

    def claim(self, delivery_id: str) -> bool:
        """Take the delivery's lease: one conditional UPDATE, so of racing senders exactly one wins."""
        now = utcnow()
        d = WebhookDelivery
        with session_scope(self.settings.database_url) as session:
            result = session.execute(
                update(d)
                .where(d.id == delivery_id, d.state == PENDING, self._unclaimed(d, now))
                .values(claimed_by=self.name, claimed_until=now + timedelta(seconds=CLAIM_S))
            )
            return bool(result.rowcount == 1)  # type: ignore[attr-defined]

    def attempt(self, delivery_id: str) -> None:
        """One attempt of a claimed delivery, and its outcome written down."""
        with session_scope(self.settings.database_url) as session:
            row = session.execute(
                select(WebhookDelivery, Webhook).join(Webhook).where(WebhookDelivery.id == delivery_id)
            ).one_or_none()
            if row is None:  # its webhook was deleted meanwhile (the delivery went with it)
                return
            delivery, hook = row.tuple()
            session.expunge_all()
        if not hook.enabled:
            self.finish(delivery, DISABLED, None)
            return
        started, at = time.monotonic(), utcnow()
        status_code, error = self.send(hook.url, hook.secret, delivery.id, delivery.payload)
        entry = {"at": at.isoformat(), "status_code": status_code, "error": error,
                 "duration_ms": round((time.monotonic() - started) * 1000, 1)}  # fmt: skip
        if status_code is not None and 200 <= status_code < 300:
            self.finish(delivery, DELIVERED, entry)
        elif status_code == 410:
            self.disable(hook.id, f"the endpoint answered 410 Gone at {at.isoformat()}")
            self.finish(delivery, DISABLED, entry)
        elif utcnow() >= as_utc(delivery.created_at) + RETRY_WINDOW:
            self.finish(delivery, FAILED, entry)
        else:
            wait = backoff_s(delivery.attempts + 1, self.settings.webhook_backoff_seconds)
            self.finish(delivery, PENDING, entry, next_at=utcnow() + timedelta(seconds=wait))
        if error:
            log.info("webhook %s delivery %s: %s", hook.id, delivery.id, error)

    def send(self, url: str, secret: str, delivery_id: str, payload: dict[str, Any]) -> tuple[int | None, str | None]:
        """POST the signed payload to the checked address; (status code, None) or (None, what failed)."""
        body = json.dumps(payload, separators=(",", ":")).encode()
        timestamp = int(time.time())
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        try:
            allow = self.settings.allow_private_targets
            address = pinned_address(host, port, allow_private=allow, resolve=self.resolve)
        except (OSError, ValueError, UnicodeError) as exc:
            return None, str(exc) if isinstance(exc, ForbiddenAddress) else f"cannot resolve {host}: {exc}"
        literal = f"[{address}]" if ":" in address else address
        target = urlunsplit((parts.scheme, f"{literal}:{port}", parts.path or "/", parts.query, ""))
        headers = {
            "host": parts.netloc.rsplit("@", 1)[-1],
            "content-type": "application/json",
            "user-agent": "trainjobs-webhooks",
            "webhook-id": delivery_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(secret, delivery_id, timestamp, body),
        }
        try:
            answer = self.client.post(target, content=body, headers=headers, extensions={"sni_hostname": host})
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return answer.status_code, None

    def finish(
        self, delivery: WebhookDelivery, state: str, entry: dict[str, Any] | None, *, next_at: datetime | None = None
    ) -> None:
        """Write an attempt's outcome and release the claim (only while it is still this sender's)."""
        values: dict[str, Any] = {"state": state, "claimed_by": None, "claimed_until": None}
        if entry is not None:
            values |= {"attempts": delivery.attempts + 1, "attempt_log": [*delivery.attempt_log, entry]}
        if state == DELIVERED:
            values["delivered_at"] = utcnow()
        if next_at is not None:
            values["next_attempt_at"] = next_at
        d = WebhookDelivery
        with session_scope(self.settings.database_url) as session:
            session.execute(update(d).where(d.id == delivery.id, d.claimed_by == self.name).values(**values))

    def disable(self, webhook_id: str, reason: str) -> None:
        """The endpoint is gone: the webhook stops, and none of its pending deliveries is sent."""
        with session_scope(self.settings.database_url) as session:
            hook = update(Webhook).where(Webhook.id == webhook_id)
            session.execute(hook.values(enabled=False, disabled_reason=reason))
            session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.webhook_id == webhook_id, WebhookDelivery.state == PENDING)
                .values(state=DISABLED)
            )
