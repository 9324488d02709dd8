"""``GET /v1/jobs/{id}/logs``: the run's output (its stderr and stray stdout lines), page by page or followed.

Where the text is: while a job runs, its slot appends to ``<home>/runs/<id>/worker.log``
(``worker.paths.RunPaths.log_file``), which the API reads when it shares the home with the
worker (``trainjobs dev``, one-machine installs); when the run ends the slot stores the same file
as the artifact ``worker.log``, which every API process can read. The live file wins while it exists.

Offsets are byte offsets into that file, so ``next_offset`` resumes exactly where a page stopped.

A job of several nodes (worker/gang.py) logs on every node: ``worker.log`` is the one whose events are
the job's (rank 0's), and ``?node=K`` reads node K's own log, stored as ``node-K.log`` when its part ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import IO, Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.deps import OwnedJob, get_sessionmaker_for
from api.problems import Problem
from api.schemas.common import MAX_INT64, problem_responses
from service_core.artifacts import ArtifactStore
from service_core.db.models import Job
from service_core.runs import RUN_LOG_NAME, node_log_name, run_work_dir
from service_core.settings import Settings
from service_core.status import JobStatus

router = APIRouter(prefix="/v1/jobs", tags=["logs"], responses=problem_responses(401, 404, 422))

MAX_CHUNK = 256 * 1024
FOLLOW_POLL_S = 0.5


class LogChunk(BaseModel):
    offset: int = Field(description="Byte offset this text starts at.")
    next_offset: int = Field(description="Pass as `offset` to continue.")
    text: str = Field(description="UTF-8 text (never split inside a character).")
    complete: bool = Field(description="The job has ended and this page reaches the end of its log.")


def live_log(settings: Settings, job_id: str) -> Path:
    """The file the worker appends to while the run is alive."""
    return run_work_dir(settings.home, job_id) / RUN_LOG_NAME


def open_log(settings: Settings, store: ArtifactStore, job_id: str, node: int | None = None) -> IO[bytes] | None:
    path = live_log(settings, job_id)
    if node is None and path.is_file():
        return path.open("rb")
    name = RUN_LOG_NAME if node is None else node_log_name(node)
    if store.exists(job_id, name):
        return store.open(job_id, name)
    return None


def utf8_boundary(data: bytes) -> int:
    """Length of ``data`` without a trailing, incomplete UTF-8 character (read it on the next page)."""
    end = len(data)
    back = 0
    while back < min(4, end) and data[end - 1 - back] & 0xC0 == 0x80:
        back += 1
    if back < end:
        lead = data[end - 1 - back]
        need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
        if lead >= 0xC0 and need > back + 1:
            return end - 1 - back
    return end


def read_chunk(
    settings: Settings, store: ArtifactStore, job_id: str, offset: int, limit: int, node: int | None = None
) -> tuple[bytes, bool]:
    """Up to ``limit`` bytes from ``offset``, and whether they reach the end of the log as it is now."""
    handle = open_log(settings, store, job_id, node)
    if handle is None:
        return b"", True
    with handle:
        handle.seek(offset)
        data = handle.read(limit)
    return data[: utf8_boundary(data)], len(data) < limit


def job_ended(maker: sessionmaker[Session], job_id: str) -> bool:
    with maker() as session:
        return JobStatus(session.execute(select(Job.status).where(Job.id == job_id)).scalar_one()).terminal


async def follow_stream(request: Request, job_id: str, offset: int) -> AsyncGenerator[bytes, None]:
    """The log's bytes from ``offset`` as they are written, ending once the job has ended and all is sent."""
    settings, store = request.app.state.settings, request.app.state.artifacts
    maker = get_sessionmaker_for(request)
    while True:
        # Status first: a job seen ended here has written all of its log, so the read after it is the last.
        ended = await run_in_threadpool(job_ended, maker, job_id)
        data, _ = await run_in_threadpool(read_chunk, settings, store, job_id, offset, MAX_CHUNK)
        if data:
            offset += len(data)
            yield data
            continue
        if ended:
            return
        await asyncio.sleep(FOLLOW_POLL_S)


@router.get(
    "/{job_id}/logs",
    response_model=LogChunk,
    responses={200: {"content": {"text/plain": {}}, "description": "JSON page; with follow=true, a text stream"}},
)
def job_logs(
    job: OwnedJob,
    request: Request,
    offset: Annotated[
        int, Query(ge=0, le=MAX_INT64, description="Byte offset to start from (`next_offset` of the last page).")
    ] = 0,
    limit: Annotated[int, Query(ge=16, le=MAX_CHUNK, description="At most this many bytes.")] = 64 * 1024,
    follow: Annotated[bool, Query(description="Stream text/plain as it is written, until the job ends.")] = False,
    node: Annotated[
        int | None, Query(ge=0, le=63, description="A multi-node job's node K: its own log, once its part ended.")
    ] = None,
) -> LogChunk | StreamingResponse:
    """A page of the run's output from ``offset``; empty until the run has started writing."""
    if node is not None and node >= job.nodes:
        message = f"the job runs on {job.nodes} node(s), numbered from 0"
        raise Problem(422, f"node: {message}", errors=[{"field": "node", "message": message}])
    if node is not None and follow:
        message = "a node's log is read once its part ended; follow the job's own log (no node)"
        raise Problem(422, f"follow: {message}", errors=[{"field": "follow", "message": message}])
    if follow:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Log-Offset": str(offset)}
        stream = follow_stream(request, job.id, offset)
        return StreamingResponse(stream, media_type="text/plain; charset=utf-8", headers=headers)
    ended = JobStatus(job.status).terminal
    data, at_end = read_chunk(request.app.state.settings, request.app.state.artifacts, job.id, offset, limit, node)
    text = data.decode("utf-8", errors="replace")
    return LogChunk(offset=offset, next_offset=offset + len(data), text=text, complete=ended and at_end)
