"""Turn a run's events into database rows: job events, metric points and the job's live fields.

Events are buffered and written in small batches (one transaction per batch), in the order the run
emitted them. Each stored event gets the next ``seq`` of its job; the metric points of a ``metric``
or ``eval`` event (one row per value name) share that event's ``seq``, so "points after seq S" and
"events after Last-Event-ID S" mean the same thing.

Progress events arrive every step; rows for them are throttled to a few per second, but the job's
``progress_step`` always follows the newest one and the last progress event is always stored.

Every write carries the attempt's fencing token: once the job was requeued or claimed again, a
batch is refused whole (``FencedOut``) and this slot's run is killed (worker/lease.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service_core.db.base import as_utc
from service_core.db.jobstore import FencedOut, add_events, fence
from service_core.db.models import Job, JobEvent, MetricPoint
from trainer_core.events import Event
from trainer_core.trackers import parse_links
from worker.lease import fenced_out

SessionFactory = Callable[[], AbstractContextManager[Session]]

STORED_KINDS = ("progress", "metric", "eval", "memory", "log", "checkpoint", "trackers")
PROGRESS_ROWS_PER_SECOND = 5.0


def event_time(event: Event) -> datetime | None:
    """The event's own UTC timestamp (``time``), or None when it has none or it does not parse."""
    raw = event.get("time")
    if not isinstance(raw, str):
        return None
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def event_data(event: Event) -> dict[str, Any]:
    """What a stored event row keeps: everything but the kind and the time (they have columns)."""
    return {k: v for k, v in event.items() if k not in ("event", "time")}


def metric_values(event: Event) -> dict[str, float | None]:
    values = event.get("values") or {}
    out: dict[str, float | None] = {}
    for name, value in values.items():
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool)):
            out[str(name)] = None if value is None else float(value)
    return out


# How long an event may wait in the buffer: the larger part of what a live SSE client waits for a
# metric, since a commit wakes its streams at once on PostgreSQL (NOTIFY; on SQLite the API's
# last_seq watcher looks every 0.2 s: api/event_listeners.py). At most ten small transactions per
# second per running job.
FLUSH_INTERVAL_S = 0.1


class EventIngestor:
    """Buffers a job's run events and writes them in batches through ``session_factory``."""

    def __init__(
        self,
        job_id: str,
        session_factory: SessionFactory,
        *,
        max_batch: int = 50,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        progress_rows_per_s: float = PROGRESS_ROWS_PER_SECOND,
        attempt: int | None = None,
    ) -> None:
        self.job_id = job_id
        # The claim's fencing token: with it, every write matches only while this attempt is running.
        self.attempt = attempt
        self.fence = fence(attempt) if attempt is not None else ()
        self.session_factory = session_factory
        self.max_batch = max_batch
        self.flush_interval_s = flush_interval_s
        self.min_progress_gap_s = 1.0 / progress_rows_per_s if progress_rows_per_s > 0 else 0.0
        self.pending: list[Event] = []
        self.held_progress: Event | None = None  # newest progress event not stored yet (throttled)
        # Events at the head of ``pending`` whose write failed: it may have committed all the same.
        self.unsure = 0
        self.last_progress_row_at = float("-inf")
        self.last_flush_at = time.monotonic()
        self.latest_metrics: dict[str, Any] = {}
        self.measured_memory: dict[str, Any] | None = None

    def add(self, event: Event) -> None:
        """Queue one event (``done`` is the supervisor's business and is not stored here)."""
        kind = event.get("event")
        if kind not in STORED_KINDS:
            return
        if kind == "progress":
            now = time.monotonic()
            if now - self.last_progress_row_at < self.min_progress_gap_s:
                self.held_progress = event
                return
            self.last_progress_row_at = now
            self.held_progress = None
        elif self.held_progress is not None:
            # Keep order: a held progress event goes out before anything that came after it.
            self.pending.append(self.held_progress)
            self.held_progress = None
            self.last_progress_row_at = time.monotonic()
        self.pending.append(event)

    def due(self) -> bool:
        """Whether a batch should be written now (size or age reached)."""
        if len(self.pending) >= self.max_batch:
            return True
        waiting = bool(self.pending) or self.held_progress is not None
        return waiting and time.monotonic() - self.last_flush_at >= self.flush_interval_s

    def flush(self, *, final: bool = False) -> int:
        """Write what is buffered in one transaction; ``final`` also writes a held progress event."""
        if self.held_progress is not None and (
            final or time.monotonic() - self.last_progress_row_at >= self.min_progress_gap_s
        ):
            self.pending.append(self.held_progress)
            self.held_progress = None
            self.last_progress_row_at = time.monotonic()
        self.last_flush_at = time.monotonic()
        held = self.held_progress
        if not self.pending and held is None:
            return 0
        batch = list(self.pending)
        writing = False
        landed = 0
        try:
            with self.session_factory() as session:
                if self.unsure and self._landed(session, batch[: self.unsure]):
                    # Committed after all: drop it now, so that a failure below cannot write it twice.
                    landed = self.unsure
                    del self.pending[:landed]
                    batch = batch[landed:]
                self.unsure = 0
                writing = True
                self._write(session, batch)
                if held is not None:
                    # Not stored as a row yet (throttled), but the job's fields follow it already.
                    self._update_job(session, self._progress_fields(held))
        except FencedOut as exc:
            self.pending.clear()  # refused for good: nothing to try again
            assert self.attempt is not None  # only a fenced write raises it
            fenced_out(self.job_id, self.attempt, str(exc))
            raise
        except BaseException:
            # The connection may have died after the server committed: the next try looks first. A
            # failure before this try wrote anything (the check itself failed) leaves the earlier
            # uncertain prefix as it was: widening it to the whole buffer would make the next check
            # miss a batch that did land, and store it twice (a database outage showed one loss twice).
            if writing:
                self.unsure = len(batch)
            raise
        # Only now: a failed write (the database away) keeps the batch for the next try, in order.
        del self.pending[: len(batch)]
        return landed + len(batch)

    def _landed(self, session: Session, batch: list[Event]) -> bool:
        """Whether ``batch`` is already stored: a write that failed at COMMIT may have committed.

        Only this ingestor writes the job's non-status events (other attempts are fenced out), so
        after a failed write the newest ones are either that batch, in order, or older ones. Each
        event carries the run's own millisecond timestamp, so an older event cannot pass for it.
        """
        rows = session.execute(
            select(JobEvent.kind, JobEvent.data, JobEvent.time)
            .where(JobEvent.job_id == self.job_id, JobEvent.kind != "status")
            .order_by(JobEvent.seq.desc())
            .limit(len(batch))
        ).all()
        stored = [(kind, data, as_utc(time)) for kind, data, time in reversed(rows)]
        wanted = [(str(e["event"]), event_data(e), event_time(e)) for e in batch]
        return len(stored) == len(wanted) and all(
            s_kind == w_kind and s_data == w_data and (w_time is None or s_time == w_time)
            for (s_kind, s_data, s_time), (w_kind, w_data, w_time) in zip(stored, wanted, strict=True)
        )

    def _update_job(self, session: Session, fields: dict[str, Any]) -> None:
        result = session.execute(update(Job).where(Job.id == self.job_id, *self.fence).values(**fields))
        if self.attempt is not None and result.rowcount != 1:  # type: ignore[attr-defined]
            raise FencedOut(f"job {self.job_id}: attempt {self.attempt} is not the running attempt; progress refused")

    def _write(self, session: Session, batch: list[Event]) -> None:
        if not batch:
            return
        rows = [(str(e["event"]), event_data(e), event_time(e)) for e in batch]
        last_seq = add_events(session, self.job_id, rows, attempt=self.attempt)
        first_seq = last_seq - len(batch) + 1
        fields: dict[str, Any] = {}
        points: list[MetricPoint] = []
        for offset, event in enumerate(batch):
            kind = event["event"]
            if kind == "progress":
                fields.update(self._progress_fields(event))
            elif kind in ("metric", "eval"):
                values = metric_values(event)
                self.latest_metrics.update(values)
                step = int(event.get("step") or 0)
                epoch = event.get("epoch")
                time_ = event_time(event)
                points.extend(
                    MetricPoint(
                        job_id=self.job_id,
                        seq=first_seq + offset,
                        step=step,
                        epoch=float(epoch) if epoch is not None else None,
                        name=name,
                        value=value,
                        **({"time": time_} if time_ else {}),
                    )
                    for name, value in values.items()
                )
                fields["latest_metrics"] = dict(self.latest_metrics)
            elif kind == "memory":
                self.measured_memory = dict(event.get("values") or {})
                fields["measured_memory"] = self.measured_memory
            elif kind == "trackers":  # where the run's W&B / MLflow runs are (trainer_core/trackers.py)
                fields["tracker_links"] = parse_links(event.get("links"))
        session.add_all(points)
        if fields:
            self._update_job(session, fields)

    @staticmethod
    def _progress_fields(event: Event) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if event.get("step") is not None:
            fields["progress_step"] = int(event["step"])
        if event.get("total_steps") is not None:
            fields["progress_total"] = int(event["total_steps"])
        if event.get("epoch") is not None:
            fields["epoch"] = float(event["epoch"])
        return fields
