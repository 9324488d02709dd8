"""API keys (no HTTP here): created once and shown once, stored only as an HMAC-SHA256 under the service secret.

A key looks like ``tj_<43 url-safe characters>``; its first characters are kept as ``prefix`` so an
operator can tell keys apart without the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Connection, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service_core.db.base import utcnow
from service_core.db.models import ApiKey
from service_core.settings import Settings, get_settings

logger = logging.getLogger(__name__)

KEY_PREFIX = "tj_"
# Owners name folders under the data root, so they are restricted to safe path characters.
OWNER_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
BOOTSTRAP_OWNER = "admin"


@dataclass(frozen=True)
class Caller:
    """Who is calling: the owner their jobs and datasets belong to, and whether they see everyone's."""

    owner: str
    is_admin: bool
    key_id: str


def hash_key(key: str, secret: str) -> str:
    """The stored form of a key: hex HMAC-SHA256 under the service secret."""
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()


def _insert_key(
    session: Session, key: str, owner: str, is_admin: bool, secret: str, expires_at: datetime | None = None
) -> ApiKey:
    if not OWNER_PATTERN.match(owner):
        raise ValueError(f"owner {owner!r} must match {OWNER_PATTERN.pattern}")
    row = ApiKey(owner=owner, key_hash=hash_key(key, secret), prefix=key[:10], is_admin=is_admin, expires_at=expires_at)
    session.add(row)
    session.flush()
    return row


def create_api_key(
    session: Session,
    owner: str,
    is_admin: bool = False,
    *,
    settings: Settings | None = None,
    expires_at: datetime | None = None,
) -> str:
    """Create a key for ``owner`` and return it, ready to print (it cannot be recovered later).

    The row is flushed, not committed: the caller's transaction decides (``session_scope`` commits).
    """
    return create_api_key_row(session, owner, is_admin, settings=settings, expires_at=expires_at)[0]


def create_api_key_row(
    session: Session,
    owner: str,
    is_admin: bool = False,
    *,
    settings: Settings | None = None,
    expires_at: datetime | None = None,
) -> tuple[str, ApiKey]:
    """Like :func:`create_api_key`, also returning the stored row."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = _insert_key(session, key, owner, is_admin, (settings or get_settings()).secret_key, expires_at)
    return key, row


def revoke_api_key(session: Session, key_id: str) -> ApiKey | None:
    """Revoke a key (idempotent); None when there is no such key. Flushed, not committed."""
    row = session.get(ApiKey, key_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
        session.flush()
    return row


def touch_api_key(conn: Connection, key_id: str, every_s: float = 60.0) -> None:
    """Record that a key was used, at most once per ``every_s`` seconds (a write per request is too dear)."""
    now = utcnow()
    conn.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id)
        .where(or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < now - timedelta(seconds=every_s)))
        .values(last_used_at=now)
    )


def authenticate(db: Session | Connection, key: str, secret: str) -> Caller | None:
    """The caller for a presented key, or None when it is unknown or revoked."""
    return authenticate_hash(db, hash_key(key, secret))


def authenticate_hash(db: Session | Connection, key_hash: str) -> Caller | None:
    """The caller for a key's stored form (see :func:`hash_key`), or None when unknown or revoked.

    Three columns rather than the ORM row: loading no entity makes it work the same (and cheaply)
    on a Session or a plain Connection.
    """
    row = db.execute(
        select(ApiKey.owner, ApiKey.is_admin, ApiKey.id).where(
            ApiKey.key_hash == key_hash,
            ApiKey.revoked_at.is_(None),
            or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()),
        )
    ).first()
    if row is None:
        return None
    return Caller(owner=row.owner, is_admin=row.is_admin, key_id=row.id)


def ensure_bootstrap_key(session: Session, settings: Settings) -> None:
    """Make ``TRAINJOBS_API_KEY`` a valid admin key (idempotent; safe when several API processes start)."""
    key = settings.api_key
    if not key:
        return
    key_hash = hash_key(key, settings.secret_key)
    if session.execute(select(ApiKey.id).where(ApiKey.key_hash == key_hash)).first() is not None:
        return
    try:
        _insert_key(session, key, BOOTSTRAP_OWNER, True, settings.secret_key)
        session.commit()
        logger.info("bootstrap admin key %s... registered for owner %r", key[:6], BOOTSTRAP_OWNER)
    except IntegrityError:
        # Another API process registered it first.
        session.rollback()
