"""``GET /v1/jobs/{id}/events``: a job's events as Server-Sent Events.

Wire format, one block per stored JobEvent: ``id: <seq>``, ``event: <kind>``, ``data: <json of the
event's data plus seq and time>``. The stream replays every row after ``Last-Event-ID`` (or
``?after=``), then waits to be woken for new rows, and ends right after the terminal ``status``
event. Since ``seq`` is dense and ordered per job, resuming with the last id seen loses nothing and
repeats nothing.

Streams are pushed, not polled: a waiting stream runs no query. It reads again when its job's signal
fires (api/event_feed.py; fired by the PostgreSQL listener or the ``last_seq`` watcher,
api/event_listeners.py), and the streams of one job at one position share that read. The database
stays the source of truth: a signal only says "read again", the rows say what to send.

A stream must not hold what the rest of the API needs: while it waits it holds no thread and no
database connection (each read is one short session on the streams' own threads, so reads never
queue in front of other routes), and each owner may have only so many open (api/streams.py: 429).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncGenerator
from functools import partial
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy import and_, select
from sqlalchemy.orm import Session, sessionmaker

from api.deps import CallerDep, OwnedJob, get_sessionmaker_for
from api.event_feed import JobWakeups, SharedReads
from api.problems import Problem
from api.schemas.common import EVENT_ID_PATTERN, MAX_INT64, as_utc, problem_responses
from api.streams import SlotStreamingResponse, StreamSlots
from service_core.db.models import Job, JobEvent
from service_core.status import TERMINAL_STATUSES, JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["events"], responses=problem_responses(401, 404, 422, 429))

HEARTBEAT_S = 15.0
BATCH = 500
TERMINAL = frozenset(s.value for s in TERMINAL_STATUSES)
# What an event row's kind can be: the run's own (trainer_core/events.py; ``checkpoint`` once the
# checkpoint is complete, in the object store when that holds them; ``trackers``: the W&B / MLflow runs),
# the status moves, and the worker's out-of-memory retry records.
StoredKind = Literal[
    "status", "retry", "progress", "metric", "eval", "memory", "log", "checkpoint", "trackers", "done"
]


def format_event(row: JobEvent) -> str:
    data: dict[str, Any] = {**row.data, "seq": row.seq, "time": as_utc(row.time).isoformat()}
    return f"id: {row.seq}\nevent: {row.kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def is_terminal_status(row: JobEvent) -> bool:
    return row.kind == "status" and row.data.get("status") in TERMINAL


def fetch_after(
    maker: sessionmaker[Session], job_id: str, after: int, kinds: frozenset[str] = frozenset()
) -> tuple[list[JobEvent], bool]:
    """Rows after ``after`` (of ``kinds`` only, when given) and whether the job was terminal when
    they were read (a job that is gone counts as ended).

    One statement on an autocommit connection (no BEGIN, no ROLLBACK: two round trips with the
    pool's ping instead of five, which is what bounds how fast the stream threads read under load).
    One statement also reads status and rows from one snapshot: the terminal status and its event
    commit together, so a terminal status seen here comes with its event among (or before) the rows.
    """
    on = and_(JobEvent.job_id == Job.id, JobEvent.seq > after, *([JobEvent.kind.in_(kinds)] if kinds else []))
    query = select(Job.status, JobEvent).outerjoin(JobEvent, on).where(Job.id == job_id)
    with maker() as session:
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
        result = session.execute(query.order_by(JobEvent.seq).limit(BATCH)).all()
    if not result:
        return [], True
    return [row for _, row in result if row is not None], JobStatus(result[0][0]).terminal


Fetched = tuple[list[JobEvent], bool]


async def event_stream(
    maker: sessionmaker[Session],
    job_id: str,
    after: int,
    wakeups: JobWakeups,
    reads: SharedReads[Fetched],
    limiter: anyio.CapacityLimiter | None = None,
    kinds: frozenset[str] = frozenset(),
) -> AsyncGenerator[str, None]:
    """SSE text for the job's rows after ``after`` (of ``kinds`` only, when given), ending after its
    terminal status event.

    Reads run on ``limiter``'s threads (the app's stream threads). A client that goes away is
    noticed by the server when a write fails (data or the heartbeat).
    """
    last_sent = time.monotonic()
    with wakeups.watch(job_id) as watched:
        while True:
            signal = watched.signal  # taken before the read: a wake-up during the read is not lost
            position = after
            rows, was_terminal = await reads.read(
                (signal, job_id, position, kinds),
                partial(anyio.to_thread.run_sync, fetch_after, maker, job_id, position, kinds, limiter=limiter),
            )
            for row in rows:
                yield format_event(row)
                after = row.seq
                if is_terminal_status(row):
                    return
            if rows:
                last_sent = time.monotonic()
                if len(rows) == BATCH:
                    continue
            elif was_terminal:
                return  # everything up to the end was sent on an earlier connection
            while not signal.is_set():  # heartbeats cost no query
                try:
                    await asyncio.wait_for(signal.wait(), max(0.0, HEARTBEAT_S - (time.monotonic() - last_sent)))
                except TimeoutError:
                    yield ": ping\n\n"
                    last_sent = time.monotonic()


def parse_after(header: str | None, query: int | None) -> int:
    if header is None:
        return query or 0
    if re.fullmatch(EVENT_ID_PATTERN, header.strip()) is None:
        raise Problem(
            422,
            "Last-Event-ID: must be the seq of an event (a non-negative integer)",
            errors=[{"field": "last-event-id", "message": "must be a non-negative integer"}],
        )
    return int(header)


LAST_EVENT_ID_DOC = {
    "name": "Last-Event-ID",
    "in": "header",
    "required": False,
    "description": "The `id` of the last event received: replay the events after it.",
    "schema": {"type": "string", "pattern": EVENT_ID_PATTERN},
}


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    openapi_extra={"parameters": [LAST_EVENT_ID_DOC]},
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "progress, metric, eval, memory, log, status"}
    },
)
async def job_events(
    job: OwnedJob,
    caller: CallerDep,
    request: Request,
    # Documented by hand (LAST_EVENT_ID_DOC): FastAPI would document an optional header as "string or
    # null", and a header cannot be null. parse_after checks it (a 422 naming the header).
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", include_in_schema=False)] = None,
    after: Annotated[
        int | None, Query(ge=0, le=MAX_INT64, description="Replay events with seq > after (like Last-Event-ID).")
    ] = None,
    kind: Annotated[
        list[StoredKind] | None,
        Query(description="Only events of these kinds (repeat it for several), e.g. `status` for the attempts."),
    ] = None,
) -> StreamingResponse:
    """Replay events after ``Last-Event-ID`` / ``after``, then stream new ones until the job ends."""
    start = parse_after(last_event_id, after)
    slots: StreamSlots = request.app.state.stream_slots
    slot = slots.take(caller.owner)
    kinds = frozenset(kind or ())
    state = request.app.state
    maker = get_sessionmaker_for(request)
    stream = event_stream(maker, job.id, start, state.event_wakeups, state.event_reads, state.stream_limiter, kinds)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return SlotStreamingResponse(stream, slot, media_type="text/event-stream", headers=headers)
