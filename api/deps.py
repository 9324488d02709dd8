"""Typed dependencies: routes ask for ``SessionDep``, ``CallerDep`` or ``SettingsDep`` and never
build sessions, settings or clients by hand.

The app owns its settings, engine and artifact store (``app.state``, set by ``create_app``), so tests
can run several apps on different databases in one process.

Cost matters here: FastAPI runs every plain ``def`` dependency in its threadpool, one hand-off each
(~0.2 ms of CPU on the reference machine, more than the work). The dependencies that only read
``app.state`` are therefore ``async def`` (no I/O, no hand-off), and ``get_caller`` does its key
lookup in exactly one hand-off.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Annotated

import anyio
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.auth import CALLER_SCOPE_KEY, authenticate
from api.problems import Problem, validation_problem
from service_core.artifacts import ArtifactStore
from service_core.db.models import Dataset, Job
from service_core.keys import Caller
from service_core.settings import Settings
from trainer_core.spec import FieldError

# enqueue(job_id, queue, priority, settings): the signature of service_core.queue.enqueue_job.
Enqueuer = Callable[[str, str, int, Settings], None]


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessionmaker_for(request: Request) -> sessionmaker[Session]:
    maker: sessionmaker[Session] = request.app.state.sessionmaker
    return maker


async def get_engine(request: Request) -> Engine:
    """For single statements that need no session (autocommit work on a pooled connection)."""
    engine: Engine = request.app.state.engine
    return engine


async def get_session_factory(request: Request) -> sessionmaker[Session]:
    """For ``async def`` routes that do all their database work in one threadpool call."""
    return get_sessionmaker_for(request)


async def get_db(request: Request) -> AsyncIterator[Session]:
    """One session per request; routes commit explicitly, anything left uncommitted is rolled back.

    A session keeps its connection from its first query until it closes, across the thread
    hand-offs in between; without a bound, a burst of requests waiting for threads held more
    sessions than the pool has connections and some failed after the pool timeout (500s). So
    sessions wait for one of ``app.state.session_slots`` (a number the pool is sized for), and
    the wait holds nothing.
    """
    slots: anyio.CapacityLimiter | None = getattr(request.app.state, "session_slots", None)
    async with slots or contextlib.nullcontext():
        session = get_sessionmaker_for(request)()
        try:
            yield session
        finally:
            await run_in_threadpool(session.close)


async def get_artifact_store(request: Request) -> ArtifactStore:
    store: ArtifactStore = request.app.state.artifacts
    return store


async def get_enqueuer(request: Request) -> Enqueuer:
    """``service_core.queue.enqueue_job``, imported on first use so the API starts without loading Celery.

    The app's warm-up thread has normally imported it already, so the import here costs nothing.
    """
    enqueue: Enqueuer | None = getattr(request.app.state, "enqueue", None)
    if enqueue is None:
        from service_core.queue import enqueue_job

        enqueue = request.app.state.enqueue = enqueue_job
    return enqueue


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
# scope="function": the session closes when the route returns, so a streamed response (SSE,
# downloads) never holds a connection or an open transaction while it streams.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]
SessionFactoryDep = Annotated[sessionmaker[Session], Depends(get_session_factory)]
EngineDep = Annotated[Engine, Depends(get_engine)]
ArtifactsDep = Annotated[ArtifactStore, Depends(get_artifact_store)]
EnqueueDep = Annotated[Enqueuer, Depends(get_enqueuer)]

bearer_scheme = HTTPBearer(auto_error=False, description="An API key from `trainjobs keys create`.")


async def get_caller(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Caller:
    """The caller behind ``Authorization: Bearer <key>``; 401 problem when missing or wrong.

    ``/v1/`` requests were authenticated by ``AuthGateMiddleware`` before their body was read.
    """
    caller: Caller | None = request.scope.get(CALLER_SCOPE_KEY)
    if caller is None:
        caller = await authenticate(request.app, credentials.credentials if credentials else None)
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]


def owned_job(session: Session, job_id: str, caller: Caller) -> Job:
    """The job if it exists and the caller may see it; another owner's job is a 404 like a missing one."""
    job = session.get(Job, job_id)
    if job is None or not (caller.is_admin or job.owner == caller.owner):
        raise Problem(404, f"no job {job_id!r}")
    return job


def get_owned_job(job_id: str, session: SessionDep, caller: CallerDep) -> Job:
    return owned_job(session, job_id, caller)


def owned_dataset(session: Session, dataset_id: str, caller: Caller, *, field: str | None = None) -> Dataset:
    """The dataset if the caller may use it; ``field`` turns "not found" into a 422 naming it."""
    dataset = session.execute(select(Dataset).where(Dataset.id == dataset_id)).scalar_one_or_none()
    if dataset is None or not (caller.is_admin or dataset.owner == caller.owner):
        if field is not None:
            raise validation_problem([FieldError(field, f"no dataset {dataset_id!r}", "not_found")])
        raise Problem(404, f"no dataset {dataset_id!r}")
    return dataset


OwnedJob = Annotated[Job, Depends(get_owned_job)]
