"""``GET /v1/usage``: device-hours and cost of the jobs that finished in a period, grouped by owner,
queue or UTC day, with their counts by final status. A key sees its owner's; an admin key every owner's
(or one owner's, with ``owner``). The charging rule is service_core/usage.py's."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import CallerDep, SessionDep
from api.problems import Problem
from api.schemas.common import problem_responses
from api.schemas.usage import UsageGroupOut, UsageOut
from service_core.db.base import as_utc, utcnow
from service_core.usage import GroupBy, UsageGroup, month_start, usage

router = APIRouter(prefix="/v1/usage", tags=["usage"], responses=problem_responses(401, 403, 422))


def group_out(group: UsageGroup) -> UsageGroupOut:
    return UsageGroupOut(key=group.key, device_hours=group.device_hours, cost=group.cost, jobs=group.jobs)


@router.get("", response_model=UsageOut, response_model_by_alias=True)
def get_usage(
    session: SessionDep,
    caller: CallerDep,
    start: Annotated[
        datetime | None, Query(alias="from", description="Start (inclusive; default: this UTC month's first day).")
    ] = None,
    end: Annotated[datetime | None, Query(alias="to", description="End (exclusive; default: now).")] = None,
    group_by: Annotated[GroupBy, Query(description="Group by owner, queue or UTC day.")] = "day",
    owner: Annotated[
        str | None, Query(max_length=128, description="Only this owner's jobs (another owner's: admin keys only).")
    ] = None,
) -> UsageOut:
    """Device-hours, cost and final statuses of the jobs that finished in ``[from, to)``.

    A period whose `to` is not after its `from` (either may be a default) is a 422 naming `to`."""
    if owner is not None and owner != caller.owner and not caller.is_admin:
        raise Problem(
            403,
            "owner: only an admin key may read another owner's usage",
            errors=[{"field": "owner", "message": "not your own owner name", "type": "forbidden"}],
        )
    now = utcnow()
    # A time without a zone is read as UTC, as every stored time is.
    start_at = as_utc(start) if start is not None else month_start(now)
    end_at = as_utc(end) if end is not None else now
    if end_at <= start_at:
        raise Problem(
            422,
            "to: the period ends before it starts",
            errors=[{"field": "to", "message": f"{end_at.isoformat()} is not after from", "type": "value_error"}],
        )
    whose = owner if owner is not None else (None if caller.is_admin else caller.owner)
    groups, total = usage(session, start_at, end_at, group_by, owner=whose)
    return UsageOut(
        start=start_at, end=end_at, group_by=group_by, owner=whose,
        groups=[group_out(g) for g in groups], total=group_out(total),
    )  # fmt: skip
