"""``/v1/keys``: list, create and revoke API keys (admin keys only).

A revoked key stops working at once in a process that has not seen it lately, and within
``TRAINJOBS_AUTH_CACHE_SECONDS`` in one that has (api/auth.py's cache).
"""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter, status
from sqlalchemy import select

from api.deps import CallerDep, SessionDep, SettingsDep
from api.problems import Problem
from api.schemas.common import problem_responses
from api.schemas.keys import KeyCreate, KeyCreated, KeyList, KeyOut
from service_core.db.base import utcnow
from service_core.db.models import ApiKey
from service_core.keys import Caller, create_api_key_row, revoke_api_key

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=problem_responses(401, 403, 404, 422))


def require_admin(caller: Caller) -> None:
    if not caller.is_admin:
        raise Problem(403, "only an admin key may manage keys")


@router.get("", response_model=KeyList)
def list_keys(session: SessionDep, caller: CallerDep) -> KeyList:
    """Every key (revoked and expired ones included), newest first."""
    require_admin(caller)
    rows = session.execute(select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id.desc())).scalars()
    return KeyList(items=[KeyOut.from_row(row) for row in rows])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=KeyCreated)
def create_key(body: KeyCreate, session: SessionDep, settings: SettingsDep, caller: CallerDep) -> KeyCreated:
    """Create a key; the answer holds the key itself, shown this once."""
    require_admin(caller)
    expires_at = utcnow() + timedelta(days=body.expires_in_days) if body.expires_in_days else None
    key, row = create_api_key_row(session, body.owner, body.admin, settings=settings, expires_at=expires_at)
    session.commit()
    return KeyCreated(**KeyOut.from_row(row).model_dump(), key=key)


@router.delete("/{key_id}", response_model=KeyOut)
def revoke_key(key_id: str, session: SessionDep, caller: CallerDep) -> KeyOut:
    """Revoke a key (idempotent: revoking it again changes nothing)."""
    require_admin(caller)
    row = revoke_api_key(session, key_id)
    if row is None:
        raise Problem(404, f"no key {key_id!r}")
    session.commit()
    return KeyOut.from_row(row)
