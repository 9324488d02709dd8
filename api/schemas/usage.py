"""Usage as ``GET /v1/usage`` answers it: device-hours, cost and job counts per group (service_core/usage.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.schemas.common import UtcDatetime


class UsageGroupOut(BaseModel):
    key: str = Field(description="The owner, the queue, or the UTC day (YYYY-MM-DD) the group is of.")
    device_hours: float = Field(description="Seconds in `running` over every attempt × devices / 3600.")
    cost: float | None = Field(description="Device-hours × each job's price at submit; null when no job had one.")
    jobs: dict[str, int] = Field(description="Jobs that finished in the period, by final status.")


class UsageOut(BaseModel):
    start: UtcDatetime = Field(serialization_alias="from")
    end: UtcDatetime = Field(serialization_alias="to")
    group_by: Literal["owner", "queue", "day"]
    owner: str | None = Field(description="Whose jobs: the caller's, or for an admin one owner's or (null) all.")
    groups: list[UsageGroupOut]
    total: UsageGroupOut
