"""What jobs cost: device-hours charged, their price, usage over a period, and monthly budgets (issue 29).

One rule, used by the job detail, ``GET /v1/usage`` and the budget check at submit:

* A job is **charged** ``run_seconds × devices`` device-seconds: ``run_seconds`` adds up every
  attempt's time in ``running`` (``service_core.db.jobstore.transition`` adds each attempt as it ends),
  ``devices`` is what each attempt held (``JobSpec.world_size``).
* Its **cost** is the charged device-hours times the queue's price per device-hour
  (``TRAINJOBS_QUEUE_PRICES``) *when the job was submitted*, stored on the job, so a later price change
  does not rewrite past bills. A queue without a price costs nothing (``cost`` is null).
* **Usage** over a period counts the jobs that *finished* in it (a running job is counted when it
  ends), grouped by owner, queue or UTC day.
* A **monthly budget** (``TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS``) is spent by the owner's jobs that
  finished this UTC month, and reserved by its unfinished ones at their predicted device-hours (at
  least what they ran so far). A submit whose own prediction does not fit in what is left is refused.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from service_core.db.base import as_utc, utcnow
from service_core.db.models import Job
from service_core.status import JobStatus

GroupBy = Literal["owner", "queue", "day"]
# The key of TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS that applies to every owner not named.
EVERY_OWNER = "*"


def device_hours(run_seconds: float, devices: int) -> float:
    return run_seconds * devices / 3600.0


def cost_of(hours: float, price: float | None) -> float | None:
    return None if price is None else hours * price


def charged_seconds(job: Job, now: datetime | None = None) -> float:
    """Seconds ``job`` has run over all its attempts, the running one up to ``now`` included."""
    seconds = job.run_seconds or 0.0
    if job.status == JobStatus.running.value and job.started_at is not None:
        seconds += max(0.0, ((now or utcnow()) - as_utc(job.started_at)).total_seconds())
    return seconds


def predicted_device_hours(estimate: dict[str, Any] | None, devices: int) -> float | None:
    """The time estimate's seconds (its median) as device-hours; None when it made no prediction."""
    seconds = ((estimate or {}).get("time") or {}).get("seconds")
    return None if seconds is None else device_hours(float(seconds), devices)


def month_start(now: datetime) -> datetime:
    """The start of ``now``'s UTC calendar month: budgets are monthly, in UTC."""
    now = now.astimezone(UTC)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


@dataclass
class UsageGroup:
    key: str
    device_hours: float = 0.0
    cost: float | None = None
    jobs: dict[str, int] = field(default_factory=dict)  # final status -> count

    def add(self, hours: float, price: float | None, status: str) -> None:
        self.device_hours += hours
        if price is not None:
            self.cost = (self.cost or 0.0) + hours * price
        self.jobs[status] = self.jobs.get(status, 0) + 1


def usage(
    session: Session, start: datetime, end: datetime, group_by: GroupBy, owner: str | None = None
) -> tuple[list[UsageGroup], UsageGroup]:
    """The jobs that finished in ``[start, end)`` (of ``owner``, or of every owner for None), grouped;
    the groups in key order and their total."""
    query = select(Job.owner, Job.queue, Job.status, Job.finished_at, Job.run_seconds, Job.devices,
                   Job.price_per_device_hour).where(Job.finished_at >= start, Job.finished_at < end)  # fmt: skip
    if owner is not None:
        query = query.where(Job.owner == owner)
    groups: dict[str, UsageGroup] = defaultdict(lambda: UsageGroup(""))
    total = UsageGroup("total")
    # Grouped here, not in SQL: "the UTC day of a timestamp" reads differently on SQLite and PostgreSQL,
    # and the rows are a few narrow columns of the finished_at index's range.
    for row in session.execute(query):
        key = {"owner": row.owner, "queue": row.queue, "day": as_utc(row.finished_at).date().isoformat()}[group_by]
        hours = device_hours(row.run_seconds or 0.0, row.devices or 1)
        group = groups[key]
        group.key = key
        group.add(hours, row.price_per_device_hour, row.status)
        total.add(hours, row.price_per_device_hour, row.status)
    return [groups[k] for k in sorted(groups)], total


def monthly_budget(budgets: dict[str, float], owner: str) -> float | None:
    """The owner's monthly device-hours (its own entry, else the ``*`` entry); None: no budget."""
    return budgets.get(owner, budgets.get(EVERY_OWNER))


# Statuses whose jobs will still run: their predicted hours are committed.
UNFINISHED = (JobStatus.queued.value, JobStatus.running.value, JobStatus.paused.value)


def committed_hours(session: Session, owner: str, now: datetime | None = None) -> float:
    """Device-hours of ``owner``'s budget this month: its jobs that finished since the month began,
    and its unfinished jobs (paused ones too: they will run) at their predicted device-hours (at least what
    they ran already)."""
    now = now or utcnow()
    rows = session.execute(
        select(Job.status, Job.started_at, Job.finished_at, Job.run_seconds, Job.devices, Job.estimate).where(
            Job.owner == owner,
            (Job.finished_at >= month_start(now)) | Job.status.in_(UNFINISHED),
        )
    ).all()
    hours = 0.0
    for row in rows:
        ran = row.run_seconds or 0.0
        if row.status == JobStatus.running.value and row.started_at is not None:
            ran += max(0.0, (now - as_utc(row.started_at)).total_seconds())
        spent = device_hours(ran, row.devices or 1)
        if row.finished_at is None:
            spent = max(spent, predicted_device_hours(row.estimate, row.devices or 1) or 0.0)
        hours += spent
    return hours
