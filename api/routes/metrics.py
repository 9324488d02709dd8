"""``GET /v1/jobs/{id}/metrics``: a job's metric points in ``seq`` order, page by page."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy import select

from api.deps import OwnedJob, SessionDep
from api.schemas.common import problem_responses
from api.schemas.jobs import MetricPage, MetricPointOut
from service_core.db.models import MetricPoint

router = APIRouter(prefix="/v1/jobs", tags=["metrics"], responses=problem_responses(401, 404, 422))


@router.get("/{job_id}/metrics", response_model=MetricPage)
def job_metrics(
    job: OwnedJob,
    session: SessionDep,
    after: Annotated[int, Query(ge=0, description="Only points with seq > after.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10000, description="At most this many points (a seq is never split).")] = 1000,
    name: Annotated[list[str] | None, Query(description="Only these metric names (repeatable), e.g. loss.")] = None,
) -> MetricPage:
    """Points ordered by (seq, name). A page never splits the points of one seq, so ``next_after``
    (the last seq returned) resumes exactly where it stopped."""
    query = select(MetricPoint).where(MetricPoint.job_id == job.id, MetricPoint.seq > after)
    if name:
        query = query.where(MetricPoint.name.in_(name))
    rows = list(session.execute(query.order_by(MetricPoint.seq, MetricPoint.name).limit(limit + 1)).scalars())
    has_more = len(rows) > limit
    if has_more:
        cut = rows[limit].seq
        whole = [r for r in rows[:limit] if r.seq != cut]
        # One seq holding more than `limit` points: return it whole rather than stall.
        rows = whole or list(session.execute(query.where(MetricPoint.seq == cut).order_by(MetricPoint.name)).scalars())
    items = [
        MetricPointOut(seq=r.seq, step=r.step, epoch=r.epoch, name=r.name, value=r.value, time=r.time) for r in rows
    ]
    return MetricPage(items=items, next_after=rows[-1].seq if rows else after, has_more=has_more)
