"""API keys as the admin routes show them (never the key itself, except once when created)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.common import UtcDatetime
from service_core.db.models import ApiKey
from service_core.keys import OWNER_PATTERN


class KeyCreate(BaseModel):
    # JSON types as the schema says them (no `1` for `admin`); no nested models, so the config says it.
    model_config = ConfigDict(strict=True, allow_inf_nan=False)

    owner: str = Field(pattern=OWNER_PATTERN.pattern, examples=["alice"])
    admin: bool = Field(default=False, description="The key sees and manages every owner's jobs and keys.")
    expires_in_days: float | None = Field(
        default=None, gt=0, le=3650, description="The key stops working after this many days (default: never)."
    )


class KeyOut(BaseModel):
    id: str
    owner: str
    prefix: str = Field(description="The key's first characters, to tell keys apart.")
    is_admin: bool
    created_at: UtcDatetime
    expires_at: UtcDatetime | None
    last_used_at: UtcDatetime | None = Field(description="Recorded at most once a minute per API process.")
    revoked_at: UtcDatetime | None

    @classmethod
    def from_row(cls, row: ApiKey) -> KeyOut:
        return cls(
            id=row.id,
            owner=row.owner,
            prefix=row.prefix,
            is_admin=row.is_admin,
            created_at=row.created_at,
            expires_at=row.expires_at,
            last_used_at=row.last_used_at,
            revoked_at=row.revoked_at,
        )


class KeyCreated(KeyOut):
    key: str = Field(description="The key itself: shown this once, stored only as an HMAC.")


class KeyList(BaseModel):
    items: list[KeyOut]
